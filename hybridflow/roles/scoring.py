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
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from hybridflow.data import fields as F
from hybridflow.rewards.guard import Outcome, RewardValueError, reward_value
from hybridflow.rewards.remote import EndpointError
from hybridflow.rewards.scorer import PROCESS_REWARDS, BatchScorer, FunctionScorer

__all__ = ["RewardError", "RewardValueError", "score", "score_rule", "rule_outcomes", "reward_counts",
           "build_scorer", "batch_rows"]

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
        outcomes = scorer.score_batch(batch_rows(batch), batch.get(F.PROMPT_TEXT, ()))
    except EndpointError as exc:  # the endpoint itself failed: one error naming it, not rows scored 0
        raise RewardError(str(exc)) from None
    finally:
        if scorer is not reward:
            scorer.close()
    failed = [i for i, o in enumerate(outcomes) if o.failed]
    if failed:
        first = outcomes[failed[0]]
        text = (f"{first.text}; on row {failed[0]} (data_source {batch[F.DATA_SOURCE][failed[0]]!r}), the first "
                f"of {len(failed)} failing rows of {len(outcomes)}")
        if len(failed) > scorer.max_failure_fraction * len(outcomes):
            raise RewardError(f"{text}, more than reward.max_failure_fraction="
                              f"{scorer.max_failure_fraction:g} of the batch")
        log.warning("%s: those rows score 0", text)
    return outcomes


def score_rule(batch: dict[str, Any], reward: Any, name: str) -> dict[str, Any]:
    """`batch` with RULE_SCORES, REWARD_FAILED and REWARD_TIMED_OUT (1.0 on the rows that scored 0 for it)
    and RULE_REWARD_SECONDS, the seconds that took spread over the rows: where the rollout scores, the
    scoring's time would otherwise count only in the rollout's."""
    started = time.perf_counter()
    outcomes = rule_outcomes(batch, reward, name)
    n = len(outcomes)
    batch[F.RULE_SCORES] = torch.tensor([o.score for o in outcomes], dtype=torch.float32)
    batch[F.REWARD_FAILED] = torch.tensor([float(o.failed) for o in outcomes])
    batch[F.REWARD_TIMED_OUT] = torch.tensor([float(o.kind == "timeout") for o in outcomes])
    batch[F.RULE_REWARD_SECONDS] = torch.full((n,), (time.perf_counter() - started) / max(n, 1))
    return batch


def reward_counts(batch: dict[str, Any]) -> dict[str, float]:
    """reward/failures and reward/timeouts: the rows of `batch` that scored 0 for it (the fields are dropped)."""
    if F.REWARD_FAILED not in batch:
        return {}
    return {"reward/failures": batch.pop(F.REWARD_FAILED).sum().item(),
            "reward/timeouts": batch.pop(F.REWARD_TIMED_OUT).sum().item()}
