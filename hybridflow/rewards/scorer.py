"""What a scorer is: scores for a batch of rows, with each failing row scored 0 and told apart.

A scorer has `name` (how errors name it), `max_failure_fraction`,
`score_batch(rows, prompts) -> list[Outcome]` (one per row: a score, or why
the row scored 0) and `close()`; a row is the reward function's four
arguments (data_source, solution_str, ground_truth, extra_info) and
`prompts` the prompt text of each. `roles.scoring` builds one from the
`reward` config section and applies the failure rule. Kinds:

* `FunctionScorer`: `reward.function` row by row, guarded (`rewards/guard.py`);
  `math` and `code` (`PROCESS_REWARDS`) always score in worker processes, since
  a sympy comparison or a program can hang or crash the process that runs it;
* `rewards.remote.HttpReward`: batches POSTed to an endpoint;
* `JudgedApart`: nothing here, every row 0: a judge on a group of its own
  (`workers/judge.py`) scores the rows once the rollout is back on the driver.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

from hybridflow.rewards.guard import GuardedReward, Outcome

__all__ = ["BatchScorer", "FunctionScorer", "JudgedApart", "PROCESS_REWARDS"]

# Registered rewards that run only in worker processes: name -> processes used when reward.workers is 0.
PROCESS_REWARDS = {"math": 2, "code": 2}


class BatchScorer(Protocol):
    name: str
    max_failure_fraction: float

    def score_batch(self, rows: Sequence[tuple], prompts: Sequence[str]) -> list[Outcome]: ...

    def close(self) -> None: ...


class FunctionScorer:
    """A row-by-row reward function (verl's signature), each call guarded by a time limit."""

    def __init__(self, fn: Callable, name: str, timeout_s: float = 30.0, workers: int = 0,
                 max_failure_fraction: float = 0.1):
        self.name, self.max_failure_fraction = name, max_failure_fraction
        self.guard = GuardedReward(fn, name, timeout_s, workers)

    def score_batch(self, rows: Sequence[tuple], prompts: Sequence[str] = ()) -> list[Outcome]:
        return self.guard.score_rows(rows)

    def close(self) -> None:
        self.guard.close()


class JudgedApart:
    """The rollout's scorer when reward.judge.placement puts the judge on a group of its own: each row 0 and
    none failed here; the driver replaces the scores with the judge group's (`workers.judge.judge_stage`)."""

    def __init__(self, name: str, max_failure_fraction: float = 0.1):
        self.name, self.max_failure_fraction = name, max_failure_fraction

    def score_batch(self, rows: Sequence[tuple], prompts: Sequence[str] = ()) -> list[Outcome]:
        return [Outcome(0.0) for _ in rows]

    def close(self) -> None:
        pass
