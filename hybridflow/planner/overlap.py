"""The iteration time of each `trainer.off_policy` mode with a rollout group apart, as a pure function.

    iteration_seconds(mode, SplitStages(rollout=..., sync=..., prep=..., update=...), max_staleness=2)

Plain seconds in, seconds per step out; the planner feeds it its cost model's stages (`search.py`,
split-all candidates) and `bench async` its calibrated model's and its own measured ones. What each mode
serialises in hybridflow's implementation (`dataflow/off_policy.py`, `trainer/trainer.py`):

- The weight sync is a set of collectives spanning both groups (`hybrid_engine/weight_sync.py`): the
  training ranks send while the rollout ranks receive, so a sync occupies both sides at once, whatever
  the mode. The training side broadcasts a staged copy on a lane of its own (`send_staged`, aside the
  update in progress, on the CPU), and a sync starts when one side has been idle waiting for the other
  (the trainer for a batch, or the rollout for a version the staleness bound lets it use).
- `sync` (lock step): the push, then the rollout, then the training side's preparation and update, one
  after the other: `sync + rollout + prep + update`.
- `one_step`: while update t runs, the rollout generates batch t + 1 from the weights of before it (the
  stream loads version t - 1, broadcasting the copy staged after update t - 1, then generates). Per step
  each side does its own work between two syncs: `sync + max(rollout, prep + update + stage)`. One term
  is the mode's own: the staged copy of each training rank's shard (a clone, for the stream to broadcast
  later). The old log-prob pass (the proximal policy) runs where lock step runs it, so it is in `prep`:
  for one optimizer step a batch the update's own log-probs are the proximal policy's.
- `async`, `max_staleness` k >= 1, weights pushed every `sync_every` = e updates (stale_samples=wait):
  the rollout may run up to k versions ahead. With e = 1 every batch still loads a newer version, so the
  steady state is one_step's: the larger bound buys slack against steps of unequal length (a long-tailed
  batch), not a shorter mean step; this model of means does not see that slack. With e > 1 a sync (and a
  staged copy) happens every e steps: `sync / e + max(rollout, prep + update + stage / e)`.
  k = 0 is sync's lock step (the schedule is the same), with the staged copy added.

Not modelled: the driver's share between calls (summing the scores, filtering groups, Ray's per-call
overhead: a few milliseconds a call on these machines), chunked generation overlapping preparation within a step
(`dataflow.async_execution`), and `stale_samples: drop` (regenerated batches).
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("sync", "one_step", "async")


@dataclass(frozen=True)
class SplitStages:
    """Seconds of one step's stages with the rollout apart (each >= 0).

    rollout: generating the step's batch on the rollout group (the sync excluded);
    sync: one weight sync, training group -> rollout group (both take part);
    prep: the training side's preparation (reward, reference, values, old log-probs where the update takes
        more than one optimizer step);
    update: the critic's and actor's updates;
    stage: the staged copy of a training rank's shard an off-policy push makes.
    """

    rollout: float
    sync: float
    prep: float
    update: float
    stage: float = 0.0

    def __post_init__(self):
        for name, value in vars(self).items():
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"SplitStages.{name} must be >= 0 seconds, got {value!r}")


def iteration_seconds(mode: str, s: SplitStages, max_staleness: int = 1, sync_every: int = 1) -> float:
    """The steady-state seconds per step of `mode` (module docstring); `max_staleness` and `sync_every` are
    async's (one_step is async with k = 1, e = 1)."""
    if mode not in MODES:
        raise ValueError(f"off_policy mode must be one of {MODES}, got {mode!r}")
    if mode == "sync":
        return s.sync + s.rollout + s.prep + s.update
    if mode == "one_step":
        max_staleness, sync_every = 1, 1
    if not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    train = s.prep + s.update
    if max_staleness == 0:  # lock step, as sync, with the staged copy
        return s.sync + s.rollout + train + s.stage
    return s.sync / sync_every + max(s.rollout, train + s.stage / sync_every)


def mode_label(mode: str, max_staleness: int = 1) -> str:
    """How tables name a mode: "sync", "one_step", "async k=2"."""
    return f"async k={max_staleness}" if mode == "async" else mode
