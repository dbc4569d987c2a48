"""A rollout batch scored where it is made (the rollout's worker), so that no reward can stall or kill a run.

`score_rule(batch, scorer, name)` scores every response with a scorer
(`rewards/scorer.py`: reward.function row by row with a time limit, an HTTP
endpoint, or a judge model, `roles/judge.py`) or with a plain reward function (guarded the same
way, on a thread). A row whose reward raised, timed out, crashed its process
or returned no number scores 0, is counted (REWARD_FAILED; REWARD_TIMED_OUT)
and logged with the first error's text. More than the scorer's
`max_failure_fraction` of the batch failing stops the run with a one-line
`RewardError` naming the reward and the first failing row, e.g.
"reward.function NAME raised ZeroDivisionError: ... (at file:line)".
`score` is the unguarded path: the values as the function returns them.

`RolloutScoring` scores a rollout as it is made: with `overlap` each finished
chunk (`add`) is scored on a thread of its own while the rollout generates the
next, and `finish` collects the chunks' outcomes in order and applies the same
failure rule to the whole batch, so the fields, the counts and any RewardError
equal those of scoring the whole batch at once. `overlaps(reward)` is whether
`reward.async_scoring` asks for that.
"""
from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from hybridflow.data import fields as F
from hybridflow.rewards.guard import Outcome, RewardValueError, reward_value
from hybridflow.rewards.remote import EndpointError
from hybridflow.rewards.scorer import PROCESS_REWARDS, BatchScorer, FunctionScorer, JudgedApart

__all__ = ["RewardError", "RewardValueError", "score", "score_rule", "rule_outcomes", "reward_counts",
           "build_scorer", "batch_rows", "RolloutScoring", "overlaps", "score_with_config"]

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """Too many rows of a batch failed to score: the message, one line, names the reward (reward.function,
    or the http or judge reward) and the first failing row."""


def batch_rows(batch: dict[str, Any]) -> list[tuple]:
    """The reward function's four arguments for each row of a rollout batch."""
    return list(zip(batch[F.DATA_SOURCE], batch[F.RESPONSE_TEXT], batch[F.GROUND_TRUTH], batch[F.EXTRA_INFO]))


def build_scorer(reward: Any, fn: Optional[Callable] = None) -> BatchScorer:
    """The scorer `reward` (a RewardConfig) describes; `fn`: reward.function already loaded (else loaded here).
    `code` gets the section's sandbox limits; `math` and `code` score in processes even at reward.workers 0."""
    if reward.kind == "http":
        from hybridflow.rewards.remote import HttpReward

        return HttpReward(reward.http, reward.timeout_s, reward.max_failure_fraction)
    if reward.kind == "judge" and reward.judge.placement != "rollout":
        return JudgedApart(f"judge {reward.judge.model_path}", reward.max_failure_fraction)
    if reward.kind == "judge":
        from hybridflow.roles.judge import JudgeReward

        return JudgeReward(reward.judge, reward.max_failure_fraction)
    if fn is None:
        from hybridflow.rewards.registry import get_reward_fn

        fn = get_reward_fn(reward.function)
    if reward.function == "code":
        from hybridflow.rewards.code import code_reward

        fn = functools.partial(code_reward, limits=reward.sandbox)
    workers = reward.workers or PROCESS_REWARDS.get(reward.function, 0)
    return FunctionScorer(fn, reward.function, reward.timeout_s, workers, reward.max_failure_fraction)


def score(batch: dict[str, Any], reward_fn: Callable) -> Tensor:
    """The rule-based reward of each decoded response [B], unguarded: what the function raises propagates
    (RewardValueError for a value that is not one finite number)."""
    return torch.tensor([reward_value(reward_fn(*row), reward_fn) for row in batch_rows(batch)])


def rule_outcomes(batch: dict[str, Any], reward: Any, name: str) -> list[Outcome]:
    """One Outcome per row from `reward` (a scorer, or a plain function guarded on a thread); RewardError when
    more than the allowed fraction failed."""
    scorer = reward if hasattr(reward, "score_batch") else FunctionScorer(reward, name)
    try:
        outcomes = scored(scorer, batch_rows(batch), batch.get(F.PROMPT_TEXT, ()))
        return checked(outcomes, batch[F.DATA_SOURCE], scorer.max_failure_fraction)
    finally:
        if scorer is not reward:
            scorer.close()


def scored(scorer: BatchScorer, rows: Sequence[tuple], prompts: Sequence[str]) -> list[Outcome]:
    """The scorer's outcomes; an endpoint that itself failed is one RewardError naming it, not rows scored 0."""
    try:
        return scorer.score_batch(rows, prompts)
    except EndpointError as exc:
        raise RewardError(str(exc)) from None


def checked(outcomes: list[Outcome], sources: Sequence[str], max_failure_fraction: float) -> list[Outcome]:
    """`outcomes` of a batch's rows (`sources`: each row's data_source); RewardError naming the first failing
    row when more than `max_failure_fraction` of them failed, else a warning when any did."""
    failed = [i for i, o in enumerate(outcomes) if o.failed]
    if failed:
        first = outcomes[failed[0]]
        text = (f"{first.text}; on row {failed[0]} (data_source {sources[failed[0]]!r}), the first "
                f"of {len(failed)} failing rows of {len(outcomes)}")
        if len(failed) > max_failure_fraction * len(outcomes):
            raise RewardError(f"{text}, more than reward.max_failure_fraction={max_failure_fraction:g} of the batch")
        log.warning("%s: those rows score 0", text)
    return outcomes


def with_outcomes(batch: dict[str, Any], outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    """`batch` with RULE_SCORES, REWARD_FAILED, REWARD_TIMED_OUT and RULE_REWARD_SECONDS (see `score_rule`)."""
    n = len(outcomes)
    batch[F.RULE_SCORES] = torch.tensor([o.score for o in outcomes], dtype=torch.float32)
    batch[F.REWARD_FAILED] = torch.tensor([float(o.failed) for o in outcomes])
    batch[F.REWARD_TIMED_OUT] = torch.tensor([float(o.kind == "timeout") for o in outcomes])
    batch[F.RULE_REWARD_SECONDS] = torch.full((n,), seconds / max(n, 1))
    return batch


def score_rule(batch: dict[str, Any], reward: Any, name: str) -> dict[str, Any]:
    """`batch` with RULE_SCORES, REWARD_FAILED and REWARD_TIMED_OUT (1.0 on the rows that scored 0 for it)
    and RULE_REWARD_SECONDS, the seconds that took spread over the rows: where the rollout scores, the
    scoring's time would otherwise count only in the rollout's."""
    started = time.perf_counter()
    outcomes = rule_outcomes(batch, reward, name)
    return with_outcomes(batch, outcomes, time.perf_counter() - started)


def score_with_config(batch: dict[str, Any], reward: Any, fn: Optional[Callable] = None) -> dict[str, Any]:
    """`score_rule` with the scorer the reward section (a RewardConfig) describes (`build_scorer`: its
    kind, time limit and processes), built for this batch and closed after it."""
    scorer = build_scorer(reward, fn)
    try:
        return score_rule(batch, scorer, reward.function)
    finally:
        scorer.close()


def overlaps(reward: Any) -> bool:
    """Whether `reward` (a RewardConfig, or None) scores a rollout's chunks while the next one generates:
    reward.async_scoring true, or "auto" for every kind but judge (its model would generate beside the
    rollout's, and its greedy batches would be cut where the chunks end)."""
    if reward is None:
        return False
    return reward.async_scoring is True or (reward.async_scoring == "auto" and reward.kind != "judge")


class RolloutScoring:
    """Scores one rollout batch with `reward` (a scorer, or a plain function guarded on a thread).

    Without `overlap`, `finish(batch)` is `score_rule(batch, ...)`. With it,
    each `add(part)` (a finished chunk's rows, fields as `batch_rows` reads
    them) is scored at once on this object's thread while the caller goes on
    generating; `finish(batch)` waits for the chunks, which must hold the
    batch's rows in order, and gives the batch what `score_rule` would:
    RULE_SCORES, REWARD_FAILED and REWARD_TIMED_OUT from the same outcomes,
    the same RewardError past max_failure_fraction, and RULE_REWARD_SECONDS
    from the seconds the chunks took to score. `events`, where given, gets
    ("score_start", k) and ("score_end", k) for chunk k as they happen.
    """

    def __init__(self, reward: Any, name: str, overlap: bool = False, events: Optional[list] = None):
        self.scorer = reward if hasattr(reward, "score_batch") else FunctionScorer(reward, name)
        self.owned = self.scorer is not reward
        self.name, self.overlap, self.events = name, overlap, events
        self.parts: list[Future] = []
        self.rows = 0
        self.pool = None
        if overlap:
            if isinstance(self.scorer, FunctionScorer):
                self.scorer.guard.start()  # its processes forked here, not by the scoring thread
            self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"scoring-{name}")

    def add(self, part: dict[str, Any]) -> None:
        """Score `part` (the next chunk's rows) on the scoring thread; ignored without overlap."""
        if self.pool is None:
            return
        rows, prompts = batch_rows(part), list(part.get(F.PROMPT_TEXT, ()))
        self.rows += len(rows)
        self.parts.append(self.pool.submit(self._score_part, len(self.parts), rows, prompts))

    def _score_part(self, k: int, rows: list[tuple], prompts: list[str]) -> tuple[list[Outcome], float]:
        if self.events is not None:
            self.events.append(("score_start", k))
        started = time.perf_counter()
        try:
            return scored(self.scorer, rows, prompts), time.perf_counter() - started
        finally:
            if self.events is not None:
                self.events.append(("score_end", k))

    def finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        """`batch` scored (see the class docstring); the chunks added must be its rows, or none were."""
        try:
            if not self.parts:
                return score_rule(batch, self.scorer, self.name)
            n = len(batch[F.RESPONSE_TEXT])
            if self.rows != n:
                raise ValueError(f"the chunks scored hold {self.rows} rows, the batch {n}")
            outcomes, seconds = [], 0.0
            for part in self.parts:  # in the order added; a chunk's RewardError is raised here
                got, took = part.result()
                outcomes += got
                seconds += took
            return with_outcomes(batch, checked(outcomes, batch[F.DATA_SOURCE], self.scorer.max_failure_fraction),
                                 seconds)
        finally:
            self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        if self.owned:
            self.scorer.close()


def reward_counts(batch: dict[str, Any]) -> dict[str, float]:
    """reward/failures and reward/timeouts: the rows of `batch` that scored 0 for it (the fields are dropped)."""
    if F.REWARD_FAILED not in batch:
        return {}
    return {"reward/failures": batch.pop(F.REWARD_FAILED).sum().item(),
            "reward/timeouts": batch.pop(F.REWARD_TIMED_OUT).sum().item()}
