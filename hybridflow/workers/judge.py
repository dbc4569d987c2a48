"""The judge (`reward.kind: judge`) placed apart from the rollout, by `reward.judge.placement`.

"reward": a worker group of its own on placement.reward's devices (under Ray
its own processes; without Ray an in-process group, as every role has).
"reference": the same worker in the reference's processes (the actor's, or
the reference's group apart), started beside it as a colocated group.
The rollout then leaves every row 0 (`rewards.scorer.JudgedApart`), and
`judge_stage` gives each rollout batch back on the driver the judge's
scores: the rows are split over the group's ranks (DP_SPLIT), each rank
answers its rows greedily (`roles.judge.JudgeReward`, the same answers as in
the rollout's worker), and the driver applies the failure rule to the whole
batch as the rollout's scoring does.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from hybridflow.config.schema import RewardConfig
from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.group import RoleGroup, remote
from hybridflow.controller.worker import Worker
from hybridflow.data import fields as F
from hybridflow.rewards.guard import Outcome
from hybridflow.roles.judge import JudgeReward
from hybridflow.roles.scoring import batch_rows, checked, with_outcomes
from hybridflow.workers.driver_rows import hand_on

__all__ = ["JudgeWorker", "JudgeGroup", "judge_stage", "JUDGE_READS"]

# What the judge reads of a rollout batch: the reward function's four arguments and the prompt.
JUDGE_READS = (F.DATA_SOURCE, F.RESPONSE_TEXT, F.GROUND_TRUTH, F.EXTRA_INFO, F.PROMPT_TEXT)


class JudgeWorker(Worker):
    """The judge model (`reward.judge`) in one process, loaded on its first rows."""

    def __init__(self, cfg: RewardConfig):
        from hybridflow.workers.rl_workers import prepare_process

        prepare_process(self)
        self.judge = JudgeReward(cfg.judge, cfg.max_failure_fraction)

    @register(Dispatch.DP_SPLIT)
    def judge_rows(self, rows: dict[str, list]) -> list[tuple[Outcome, str]]:
        """This rank's rows (JUDGE_READS) -> (outcome, data_source) per row."""
        outcomes = self.judge.score_batch(batch_rows(rows), rows[F.PROMPT_TEXT])
        return list(zip(outcomes, rows[F.DATA_SOURCE]))


class JudgeGroup(RoleGroup):
    judge_rows = remote(JudgeWorker.judge_rows)


def judge_stage(group: JudgeGroup, cfg: RewardConfig) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The driver's step after each rollout: the batch with the judge group's RULE_SCORES, REWARD_FAILED,
    REWARD_TIMED_OUT and RULE_REWARD_SECONDS (`roles.scoring.with_outcomes`); RewardError past
    reward.max_failure_fraction, naming the first failing row."""
    def judged(batch: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        answers = group.judge_rows(hand_on(batch, JUDGE_READS))
        outcomes = checked([o for o, _ in answers], [s for _, s in answers], cfg.max_failure_fraction)
        return with_outcomes(batch, outcomes, time.perf_counter() - started)
    return judged
