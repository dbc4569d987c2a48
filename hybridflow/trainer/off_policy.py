"""Off-policy overlap (trainer.off_policy): the rollout group apart generates ahead while the actor trains.

The schedule is decided on the controller at step boundaries, so it is a pure
function of the config and the step (`Schedule`), the same on every run and
after a resume: at the start of step t (the trainer holding weight version
t - 1, i.e. after t - 1 updates, and the rollout group last pushed version p)
the batches of every step s up to `Schedule.limit(t, p)` are submitted, each
with version p's weights; a batch generated from version v and trained at step
s has staleness s - 1 - v.

- sync: limit = t (lock step; the trainer keeps its own path for it, the
  DataFlow with the rollout node, and does not use this module);
- one_step: limit = t + 1 with p = t - 1: batch t + 1 generates from the
  weights of before update t while update t runs (staleness 1);
- async, max_staleness k, stale_samples=wait: limit = p + k + 1 (the rollout
  runs up to k versions ahead and waits for fresher weights, which are pushed
  every sync_every updates); k = 0 is sync's schedule;
- async, stale_samples=drop: limit = t + k (the rollout never waits); a batch
  staler than k when its step comes is dropped and generated again from the
  trainer's current weights (pushed then).

`RolloutStream` runs the submitted work on one thread that alone calls the
rollout group, in submission order: each job loads the weights of its version
(when the group holds another) and generates the step's prompt chunks, so the
version stamped on every row (`F.WEIGHT_VERSION`) is the one that generated
it. The controller's main thread trains meanwhile (Ray releases the GIL while
it waits). A checkpoint holds the generated batches not trained yet (and
pushes the weights it saves), so a resumed run continues the same schedule.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hybridflow.config.schema import TrainerConfig
from hybridflow.data import fields as F

BUFFER_FILE = "rollout_buffer.pt"  # in a checkpoint step directory: generated batches of later steps
STALENESS_BUCKETS = (0, 1, 2, 3)  # histogram: samples at staleness 0, 1, 2 and >= 3


@dataclass(frozen=True)
class Schedule:
    """Which steps' batches may be generated when; `Schedule.of(cfg.trainer)`."""

    mode: str  # "one_step" | "async"
    max_staleness: int  # k
    sync_every: int
    drop: bool  # stale_samples == "drop"
    total_steps: int

    @classmethod
    def of(cls, t: TrainerConfig) -> "Schedule":
        if t.off_policy == "one_step":
            return cls("one_step", 1, 1, False, t.total_steps)
        return cls(t.off_policy, t.max_staleness, t.sync_every, t.stale_samples == "drop", t.total_steps)

    def limit(self, step: int, pushed: int) -> int:
        """The last step whose batch may be submitted at the start of `step`, the rollout holding
        pushed version `pushed` (never below `step`: the step's own batch is always allowed)."""
        ahead = step + self.max_staleness if self.drop else pushed + self.max_staleness + 1
        return min(self.total_steps, max(step, ahead))

    def pushes_after(self, version: int) -> bool:
        """Whether the weights are pushed to the rollout group once they reach `version`."""
        return version % self.sync_every == 0


def staleness_metrics(staleness: torch.Tensor) -> dict[str, float]:
    """staleness[B] (updates each row's weights lagged the trainer's) -> mean, max and bucket counts."""
    s = staleness.float()
    out = {"offpolicy/staleness_mean": s.mean().item(), "offpolicy/staleness_max": s.max().item()}
    for low in STALENESS_BUCKETS:
        last = low == STALENESS_BUCKETS[-1]
        name = f"offpolicy/staleness_{low}{'+' if last else ''}"
        out[name] = float(((s >= low) if last else (s == low)).sum().item())
    return out


@dataclass
class Generated:
    """One step's generated chunks (rollout batches) and the weight version that generated them."""

    step: int
    version: int
    chunks: list[dict[str, Any]]
    seconds: float  # generation time on the rollout group


class RolloutStream:
    """The rollout group apart, driven from one thread in submission order (module docstring).

    `generate(chunks)` is the rollout group's call for one step's prompt chunks ([(seed, prompts)]),
    `load(handles)` its weight load; `prompt_chunks(step)` gives a step's chunks.
    """

    def __init__(self, schedule: Schedule, generate: Callable[[list], list], load: Callable[[Any], None],
                 prompt_chunks: Callable[[int], list]):
        self.schedule = schedule
        self._generate, self._load, self._prompt_chunks = generate, load, prompt_chunks
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-stream")
        self._loaded = 0  # the version the rollout group holds (the thread alone changes it): model.path's
        self.pushed: tuple[int, Any] = (0, None)  # (version, handles) the next submissions generate from
        self._futures: dict[int, Future] = {}
        self._ready: dict[int, Generated] = {}  # restored from a checkpoint
        self.submitted = 0  # the last step submitted
        self.busy_s = 0.0  # the rollout group's time generating and loading
        self._lock = threading.Lock()

    # -- the thread's jobs ---------------------------------------------------
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
        chunks, seconds = self._with_version(version, handles, lambda: self._generate(self._prompt_chunks(step)))
        for chunk in chunks:
            chunk[F.WEIGHT_VERSION] = torch.full((len(chunk[F.RESPONSES]),), version, dtype=torch.long)
        return Generated(step, version, chunks, seconds)

    # -- the controller's side ----------------------------------------------
    def push(self, version: int, handles: Any) -> None:
        """Later submissions generate from these weights (the actor's published `version`)."""
        self.pushed = (version, handles)

    def submit_until(self, step: int) -> None:
        """Submit every batch the schedule allows at the start of `step`, with the pushed weights."""
        version, handles = self.pushed
        for s in range(self.submitted + 1, self.schedule.limit(step, version) + 1):
            self._futures[s] = self._thread.submit(self._generate_step, s, version, handles)
            self.submitted = s

    def take(self, step: int) -> Generated:
        """Step `step`'s batch (waiting for it); a WorkerError of the rollout group is raised here."""
        if step in self._ready:
            return self._ready.pop(step)
        return self._futures.pop(step).result()

    def regenerate(self, step: int) -> Generated:
        """Step `step`'s batch again, from the pushed weights (after a drop), behind the queued work."""
        version, handles = self.pushed
        return self._thread.submit(self._generate_step, step, version, handles).result()

    def run_now(self, version: int, handles: Any, fn: Callable[[], Any]) -> Any:
        """`fn()` (a call of the rollout group: validation) with version `version`'s weights, in turn."""
        return self._thread.submit(self._with_version, version, handles, fn).result()[0]

    def pending(self) -> list[Generated]:
        """Every batch submitted or restored and not taken yet, in step order (waits for them)."""
        out = dict(self._ready)
        out.update({s: f.result() for s, f in self._futures.items()})
        self._ready, self._futures = out, {}
        return [out[s] for s in sorted(out)]

    # -- checkpoints (the trainer passes the stream among the groups it saves and loads) ---------
    def save(self, directory: str) -> None:
        torch.save([vars(g) for g in self.pending()], Path(directory) / BUFFER_FILE)

    def load(self, directory: str) -> None:
        path = Path(directory) / BUFFER_FILE
        saved = torch.load(path, weights_only=False) if path.is_file() else []
        self._ready = {g["step"]: Generated(**g) for g in saved}
        self.submitted = max(self._ready, default=0)

    def resume_at(self, step: int) -> None:
        """Continue after `step` (restored): the batches saved with it stand; later ones follow them."""
        self.submitted = max(step, max(self._ready, default=0))

    def close(self) -> None:
        """Wait for the submitted work (its errors are the steps' to report, not the shutdown's), then stop."""
        for future in self._futures.values():
            future.exception()
        self._futures = {}
        self._thread.shutdown(wait=True)
