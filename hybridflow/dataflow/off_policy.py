"""Off-policy overlap: a rollout generating ahead of the update, within a staleness bound.

Used by the trainer (`trainer.off_policy`, the rollout group placed apart) and
by `DataFlow.run_steps` (the DataFlow API): both hand a `RolloutStream` their
generate, load and publish calls and get each step's batch from it.

The schedule is decided on the caller's thread at step boundaries, so it is a
pure function of the settings and the step (`Schedule`), the same on every
run and after a resume. At the start of step t (the trainer holding weight
version t - 1, i.e. after t - 1 updates, and the rollout last pushed version
p) the batches of every step s up to `Schedule.limit(t, p)` are submitted,
each with version p's weights; a batch generated from version v and trained at
step s has staleness s - 1 - v.

- sync: limit = t (lock step; the trainer keeps its own path for it);
- one_step: limit = t + 1 with p = t - 1: batch t + 1 generates from the
  weights of before update t while update t runs (staleness 1);
- async, max_staleness k, stale_samples "wait": limit = p + k + 1 (the rollout
  runs up to k versions ahead and waits for fresher weights, pushed every
  sync_every updates); k = 0 is sync's schedule;
- async, stale_samples "drop": limit = t + k (the rollout never waits); a batch
  staler than k when its step comes is dropped and generated again from the
  trainer's weights, pushed then.

`RolloutStream` runs the submitted work on one thread that alone generates and
loads weights, in submission order: each job loads its version's weights
(when the rollout holds another) and generates, so the version a batch
reports is the one that generated it. The caller's thread trains meanwhile.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: `from hybridflow import DataFlow` loads no torch (docs/api.md).
MODES = ("sync", "one_step", "async")
STALE_SAMPLES = ("wait", "drop")
BUFFER_FILE = "rollout_buffer.pt"  # in a checkpoint step directory: generated batches of later steps
STALENESS_BUCKETS = (0, 1, 2, 3)  # histogram: samples at staleness 0, 1, 2 and >= 3


@dataclass(frozen=True)
class Schedule:
    """Which steps' batches may be generated when (`Schedule.make`, or the trainer's `Schedule.of`)."""

    mode: str  # "sync" | "one_step" | "async"
    max_staleness: int  # k
    sync_every: int
    drop: bool  # stale_samples == "drop"
    total_steps: int

    @classmethod
    def make(cls, mode: str, total_steps: int, max_staleness: int = 1, sync_every: int = 1,
             stale_samples: str = "wait") -> "Schedule":
        """The schedule of these settings (the trainer's keys without `trainer.`, as `DataFlow.run_steps` takes
        them); ValueError names a bad one. A config's values are config/validate.py's to check (`of`)."""
        if mode not in MODES:
            raise ValueError(f"off_policy must be one of {MODES}, got {mode!r}")
        if stale_samples not in STALE_SAMPLES:
            raise ValueError(f"stale_samples must be one of {STALE_SAMPLES}, got {stale_samples!r}")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if mode == "async" and stale_samples == "wait" and sync_every > max_staleness + 1:
            raise ValueError(f"sync_every={sync_every} with max_staleness={max_staleness} and stale_samples='wait' "
                             f"leaves the rollout waiting for weights it never gets (use at most {max_staleness + 1})")
        return cls._settled(mode, total_steps, max_staleness, sync_every, stale_samples)

    @classmethod
    def of(cls, t) -> "Schedule":
        """From the trainer's section (`config.schema.TrainerConfig`), whose rules config/validate.py checked."""
        return cls._settled(t.off_policy, t.total_steps, t.max_staleness, t.sync_every, t.stale_samples)

    @classmethod
    def _settled(cls, mode: str, total_steps: int, max_staleness: int, sync_every: int,
                 stale_samples: str) -> "Schedule":
        if mode == "sync":
            return cls(mode, 0, 1, False, total_steps)
        if mode == "one_step":
            return cls(mode, 1, 1, False, total_steps)
        return cls(mode, max_staleness, sync_every, stale_samples == "drop", total_steps)

    def limit(self, step: int, pushed: int) -> int:
        """The last step whose batch may be submitted at the start of `step`, the rollout holding
        pushed version `pushed` (never below `step`: the step's own batch is always allowed)."""
        ahead = step + self.max_staleness if self.drop else pushed + self.max_staleness + 1
        return min(self.total_steps, max(step, ahead))

    def pushes_after(self, version: int) -> bool:
        """Whether the weights are pushed to the rollout once they reach `version`."""
        return version % self.sync_every == 0


def staleness_metrics(staleness: "torch.Tensor") -> dict[str, float]:
    """staleness[B] (updates each row's weights lagged the trainer's) -> mean, max and bucket counts."""
    s = staleness.float()
    out = {"offpolicy/staleness_mean": s.mean().item(), "offpolicy/staleness_max": s.max().item()}
    for low in STALENESS_BUCKETS:
        last = low == STALENESS_BUCKETS[-1]
        name = f"offpolicy/staleness_{low}{'plus' if last else ''}"  # "3plus": MLflow's names take no "+"
        out[name] = float(((s >= low) if last else (s == low)).sum().item())
    return out


@dataclass
class Generated:
    """One step's generated output and the weight version that generated it."""

    step: int
    version: int
    output: Any
    seconds: float  # generation time (and the weight load before it, if one ran)
    wait_s: float = 0.0  # how long the caller waited for it
    dropped: int = 0  # batches of this step dropped as too stale before this one


class RolloutStream:
    """The rollout, driven from one thread in submission order (module docstring).

    generate(inputs, version) -> output: generate one step's inputs (`inputs(step)`) with the loaded
        weights, which are version `version`'s;
    load(handles): load published weights into the rollout (on the stream's thread);
    publish() -> handles: the trained weights now, as a snapshot (on the caller's thread, between updates);
    portable(output) -> output: what `save` writes of a generated output (default: the output itself).
    The rollout starts with version 0's weights (nothing to load).
    """

    def __init__(self, schedule: Schedule, generate: Callable[[Any, int], Any], load: Callable[[Any], None],
                 publish: Callable[[], Any], inputs: Callable[[int], Any],
                 portable: Callable[[Any], Any] = lambda output: output):
        self.schedule = schedule
        # A generated output as a checkpoint can keep it: references into a session's object store, say,
        # resolved to what they refer to (a resumed run is another session).
        self._portable = portable
        self._generate, self._load, self._publish, self._inputs = generate, load, publish, inputs
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-stream")
        self._loaded = 0  # the version the rollout holds (the stream's thread alone changes it)
        self.pushed: tuple[int, Any] = (0, None)  # (version, handles) the next submissions generate from
        self._futures: dict[int, Future] = {}
        self._ready: dict[int, Generated] = {}  # restored from a checkpoint
        self.submitted = 0  # the last step submitted
        self.busy_s = 0.0  # the rollout's seconds generating and loading
        self._lock = threading.Lock()

    # -- the stream thread's jobs ---------------------------------------------
    def _with_version(self, version: int, handles: Any, fn: Callable[[], Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        if version != self._loaded:
            self._load(handles)
            self._loaded = version
        out = fn()
        seconds = time.perf_counter() - start
        with self._lock:
            self.busy_s += seconds
        return out, seconds

    def _generate_step(self, step: int, version: int, handles: Any) -> Generated:
        output, seconds = self._with_version(version, handles,
                                             lambda: self._generate(self._inputs(step), version))
        return Generated(step, version, output, seconds)

    def _submit(self, step: int) -> Future:
        version, handles = self.pushed
        return self._thread.submit(self._generate_step, step, version, handles)

    # -- the caller's side -----------------------------------------------------
    def push(self, version: int) -> None:
        """Publish the trained weights (version `version`): later submissions generate from them."""
        self.pushed = (version, self._publish())

    def updated(self, version: int) -> None:
        """An update made `version`: push it if the schedule says so."""
        if self.schedule.pushes_after(version):
            self.push(version)

    def next(self, step: int, version: int) -> Generated:
        """Step `step`'s batch for a trainer at `version` (waiting for it), after submitting what the
        schedule allows now; a batch staler than max_staleness (drop only) is generated again from the
        weights of now. A failure of the rollout is raised here."""
        for s in range(self.submitted + 1, self.schedule.limit(step, self.pushed[0]) + 1):
            self._futures[s] = self._submit(s)
            self.submitted = s
        start = time.perf_counter()
        got = self._ready.pop(step) if step in self._ready else self._futures.pop(step).result()
        dropped = 0
        while version - got.version > self.schedule.max_staleness:  # wait never lets this happen
            dropped += 1
            self.push(version)
            got = self._submit(step).result()
        got.wait_s, got.dropped = time.perf_counter() - start, dropped
        return got

    def run_now(self, version: int, fn: Callable[[], Any]) -> Any:
        """`fn()` (a rollout call outside the schedule: validation) with version `version`'s weights
        (published now unless pushed), in turn behind the submitted work."""
        pushed, handles = self.pushed
        if pushed != version:
            handles = self._publish()
        return self._thread.submit(self._with_version, version, handles, fn).result()[0]

    def pending(self) -> list[Generated]:
        """Every batch submitted or restored and not taken yet, in step order (waits for them)."""
        out = dict(self._ready)
        out.update({s: f.result() for s, f in self._futures.items()})
        self._ready, self._futures = out, {}
        return [out[s] for s in sorted(out)]

    def failure(self, timeout: float = 30.0):
        """The first error of the submitted work (waiting up to `timeout` s for what is in flight), or None."""
        from concurrent.futures import wait

        wait(list(self._futures.values()), timeout=timeout)
        for step in sorted(self._futures):
            future = self._futures[step]
            if future.done() and future.exception() is not None:
                return future.exception()
        return None

    # -- checkpoints: the trainer saves and loads the stream beside its groups --------------
    def save(self, directory: str) -> None:
        """The batches generated ahead (waiting for those in flight), into the step's directory."""
        import torch

        torch.save([{**vars(g), "output": self._portable(g.output)} for g in self.pending()],
                   Path(directory) / BUFFER_FILE)

    def load(self, directory: str) -> None:
        import torch

        path = Path(directory) / BUFFER_FILE
        # Tensors, numbers, strings and containers of them (`save` resolves object-store rows first): no
        # pickled objects are executed on load.
        saved = torch.load(path, weights_only=True) if path.is_file() else []
        self._ready = {g["step"]: Generated(**g) for g in saved}

    def resume(self, version: int) -> None:
        """Continue after step `version` (restored): the batches saved with it stand, later ones follow
        them; the restored weights are pushed (as the run that saved them pushed before saving)."""
        self.submitted = max(version, max(self._ready, default=0))
        self.push(version)

    def close(self) -> None:
        """Wait for the submitted work (its errors are the steps' to report, not the shutdown's), then stop."""
        for future in self._futures.values():
            future.exception()
        self._futures = {}
        self._thread.shutdown(wait=True)
