"""The one owner of the rollout's weights: a strategy per route, chosen once when a run is built.

- `LockStep`: step t's batch generates in the step from the weights after update t - 1,
  refreshed right after each update. The colocated route (the actor's processes
  generate from views, the 3D-HybridEngine's refilled shard or an FSDP gather,
  `worker_weights.ColocatedGeneration`), and `DataFlow.run_steps` in sync.
- `Apart`: lock step into a rollout group on devices of its own; the actor's ranks
  broadcast into it (`apart_sync.ApartWeightSync`) before its first call after an update.
- `Streamed`: off-policy; a `RolloutStream` (`dataflow/off_policy.py`) generates ahead
  within a staleness bound while the caller trains. `StreamedApart` feeds it the
  actor's staged, versioned snapshots over the apart sync.

Every driver (the trainer, `DataFlow.run_steps`) runs a step the same way:

    got = weights.take(step, version)     # the step's items: generated ahead, or inputs the flow generates from
    out = weights.rollout(version, call)  # any rollout call in between, with `version`'s weights
    weights.release()                     # before the update: generation memory back to training
    figures = weights.updated(step)       # after it: the trained weights on their way to the rollout

A checkpoint holds `weights.checkpointed()` and calls `saving(version)` first; a resume calls
`resume(version)`; `metrics()` hands over the figures of weight moves not reported yet; `close()` ends it.
`ahead` (fixed when built) says whether `take` returns generated batches, so the flow starts after the rollout.

A new route (LoRA adapters, expert-parallel weights) is one more strategy here with its worker-side half in
`worker_weights.py`, chosen in `trainer/build.py`; neither the trainer's loop nor the workers change.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

Metrics = dict[str, float]


@dataclass
class Taken:
    """One step's items as `take` hands them over."""

    step: int
    version: int  # the weight version that generated them (lock step: the caller's own)
    output: Any
    dropped: int = 0  # batches of this step dropped as too stale before this one (off-policy, drop)
    metrics: Metrics = field(default_factory=dict)  # the rollout's figures of this step, when it ran ahead


class LockStep:
    """Generation inside the step. `generate(items, version)` (None: the items pass on, the flow generates);
    `refresh()` brings the rollout up to the trained weights after each update and after a resume (its
    figures go with the update's); `release()` frees generation memory before an update."""

    ahead = False

    def __init__(self, inputs: Callable[[int], Any], generate: Optional[Callable[[Any, int], Any]] = None,
                 refresh: Optional[Callable[[], Optional[Metrics]]] = None,
                 release: Optional[Callable[[], None]] = None):
        self._inputs, self._generate = inputs, generate
        self._refresh, self._release = refresh, release
        self.busy_s = 0.0  # seconds in rollout calls (a weight load before one included)
        self._lock = threading.Lock()

    def take(self, step: int, version: int) -> Taken:
        items = self._inputs(step)
        if self._generate is not None:
            items = self.rollout(version, lambda: self._generate(items, version))
        return Taken(step, version, items)

    def rollout(self, version: int, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return call()
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - start

    def release(self) -> None:
        if self._release is not None:
            self._release()

    def updated(self, version: int) -> Metrics:
        return (self._refresh() or {}) if self._refresh is not None else {}

    def resume(self, version: int) -> None:
        self.updated(version)

    def saving(self, version: int) -> None:
        """Nothing beyond the groups' shards: the rollout holds the trained weights."""

    def checkpointed(self) -> list:
        return []

    def metrics(self) -> Metrics:
        return {}

    def failure(self) -> Optional[BaseException]:
        return None

    def close(self) -> None:
        """Nothing runs apart from the caller."""


class Apart(LockStep):
    """Lock step into a rollout group apart: after an update (or a resume) it holds older weights (`stale`)
    until the actor's ranks broadcast theirs into it, just before its next call; the broadcast's `sync/*`
    figures go with the step that used it (`metrics`)."""

    def __init__(self, sync, inputs: Callable[[int], Any]):
        super().__init__(inputs)
        self.sync = sync  # `apart_sync.ApartWeightSync`
        self.stale = True  # the rollout group has had no weights yet
        self._metrics: Metrics = {}
        self._push_lock = threading.Lock()  # a baseline and a rollout stage may call from two threads

    def rollout(self, version: int, call: Callable[[], Any]) -> Any:
        def pushed_then_called():
            with self._push_lock:
                if self.stale:  # actor group -> rollout group by collectives; no weight via the driver
                    self._metrics = self.sync.push()
                    self.stale = False
            return call()

        return super().rollout(version, pushed_then_called)

    def updated(self, version: int) -> Metrics:
        self.stale = True
        return {}

    def metrics(self) -> Metrics:
        out, self._metrics = self._metrics, {}
        return out


class Streamed:
    """Off-policy: `stream` (a `RolloutStream`) generates each step's batch ahead on its own thread, from
    the version its schedule gives it, while the caller trains; `ready(output)` readies a taken batch (one
    restored from an older checkpoint, say)."""

    ahead = True

    def __init__(self, stream, ready: Callable[[Any], Any] = lambda output: output):
        self.stream, self._ready = stream, ready

    @property
    def busy_s(self) -> float:
        return self.stream.busy_s

    def take(self, step: int, version: int) -> Taken:
        got = self.stream.next(step, version)
        figures = {"timing/rollout_s": got.seconds, "timing/rollout_wait_s": got.wait_s,
                   "offpolicy/dropped_batches": float(got.dropped)}
        return Taken(got.step, got.version, self._ready(got.output), got.dropped, figures)

    def rollout(self, version: int, call: Callable[[], Any]) -> Any:
        """`call` on the stream's thread (the only caller of the rollout), with `version`'s weights."""
        return self.stream.run_now(version, call)

    def release(self) -> None:
        """The rollout generates apart: nothing to free here."""

    def updated(self, version: int) -> Metrics:
        self.stream.updated(version)
        return {}

    def resume(self, version: int) -> None:
        self.stream.resume(version)

    def saving(self, version: int) -> None:
        """A resume can push only the saved weights, so the run going on pushes them too."""
        if self.stream.pushed[0] != version:
            self.stream.push(version)

    def checkpointed(self) -> list:
        return [self.stream]  # the batches generated ahead

    def metrics(self) -> Metrics:
        return {}

    def failure(self) -> Optional[BaseException]:
        return self.stream.failure()

    def close(self) -> None:
        self.stream.close()


class StreamedApart(Streamed):
    """Off-policy into a rollout group apart. Publishing version v stages a copy of each actor rank's shard
    (`sync.stage`); the stream's thread broadcasts it (`sync.push(v)`, in order with the rollouts) when a
    job first needs it, so a batch generates from exactly its scheduled version while the actor trains on.
    The rollout gets version 0 by a push before the stream starts. `make_stream(publish, load)` builds the
    stream around those two."""

    def __init__(self, sync, make_stream: Callable[[Callable, Callable], Any],
                 ready: Callable[[Any], Any] = lambda output: output):
        self.sync = sync  # `apart_sync.ApartWeightSync`
        self._version = 0  # the actor's version, which a publish stages
        self._metrics: Metrics = sync.push()
        super().__init__(make_stream(self._stage, self._load), ready)

    def _stage(self) -> int:
        self.sync.stage(self._version)
        return self._version

    def _load(self, version: int) -> None:
        self._metrics = self.sync.push(version)

    def rollout(self, version: int, call: Callable[[], Any]) -> Any:
        self._version = version
        return super().rollout(version, call)

    def updated(self, version: int) -> Metrics:
        self._version = version
        return super().updated(version)

    def resume(self, version: int) -> None:
        self._version = version
        super().resume(version)

    def saving(self, version: int) -> None:
        self._version = version
        super().saving(version)

    def metrics(self) -> Metrics:
        out, self._metrics = self._metrics, {}
        return out
