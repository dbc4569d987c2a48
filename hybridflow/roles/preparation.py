"""The token-level half of preparing an RL batch, run where the rows are (a worker), not on the driver.

The rollout scores each response where it makes it (`roles.scoring`: one
number a row), the driver sums the scores and filters groups; everything that
reads a batch's token tensors happens here, in one pass over the whole batch:

    scores on the last response token (+ an environment's per-turn rewards)
    -> [KL penalty in the reward] -> advantages and returns
    + the batch's token figures (tokens, entropy, KL to the reference, the sampler-trainer gap)

`TokenStage` is what the config decides about it, fixed when the trainer is
built. The same functions run in-process (a local or torchrun run) and in the
actor's rank 0 under Ray (`ActorRolloutRefWorker.prepare_tokens`), where the
tensors arrive from the object store and leave for it again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from hybridflow.algos import AdvantageInputs, apply_kl_penalty, behaviour_metrics, compute_advantages
from hybridflow.algos.routes import log_prob_gaps, route_metrics
from hybridflow.data import fields as F

Batch = dict[str, Any]

# What the stage reads of a batch (those it holds).
READS = (F.RESPONSE_MASK, F.ATTENTION_MASK, F.OUTCOME_SCORES, F.SCORES, F.ENV_REWARDS, F.UID, F.BASELINE_SCORES,
         F.VALUES, F.OLD_LOG_PROBS, F.REF_LOG_PROBS, F.ENTROPY, F.ROLLOUT_LOG_PROBS, F.ROUTE_MISMATCH)


@dataclass(frozen=True)
class TokenStage:
    """The config's choices for the token-level preparation."""

    estimator: str  # algorithm.adv_estimator
    gamma: float
    lam: float
    norm_by_std: bool  # algorithm.norm_adv_by_std_in_grpo
    kl_penalty: Optional[str] = None  # algorithm.kl_penalty when use_kl_in_reward, else None
    old: bool = False  # the batch holds OLD_LOG_PROBS and ENTROPY (an old log-prob pass ran)
    reference: bool = False  # ... and REF_LOG_PROBS
    correction: str = "none"  # actor.off_policy_correction (its level and threshold below)
    correction_level: str = "token"
    correction_threshold: float = 2.0


def token_scores(scores: Tensor, mask: Tensor) -> Tensor:
    """`scores` [B] placed on each row's last response token [B, R]: the last 1 of the mask, which is not the
    count of 1s minus one when a multi-turn response has tool tokens (mask 0) between the model's turns."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    m = mask.bool()
    last = torch.where(m, torch.arange(m.shape[-1]), -1).amax(-1).clamp(min=0)
    rows = torch.arange(len(scores))
    out[rows, last] = scores.float() * m.any(-1)
    return out


def env_token_rewards(batch: Batch) -> Tensor:
    """ENV_REWARDS [B, R] where the rollout had an environment, else zeros: per-turn rewards for TOKEN_SCORES."""
    return batch[F.ENV_REWARDS].float() if F.ENV_REWARDS in batch else torch.zeros(batch[F.RESPONSE_MASK].shape)


def prepare_tokens(batch: Batch, stage: TokenStage, kl_coef: float = 0.0) -> tuple[Batch, dict[str, float]]:
    """TOKEN_SCORES, TOKEN_REWARDS, ADVANTAGES and RETURNS of the whole `batch` (rows as the driver holds
    them), and the batch's token figures; with a KL penalty in the reward, `actor/kl_in_reward` among them
    (the mean KL the driver's controller adapts its coefficient to)."""
    mask = batch[F.RESPONSE_MASK]
    scores = token_scores(batch[F.OUTCOME_SCORES], mask) + env_token_rewards(batch)
    out = {F.TOKEN_SCORES: scores, F.TOKEN_REWARDS: scores}
    metrics = token_metrics(batch, stage)
    if stage.kl_penalty is not None:
        out[F.TOKEN_REWARDS], metrics["actor/kl_in_reward"] = apply_kl_penalty(
            scores, batch[F.OLD_LOG_PROBS], batch[F.REF_LOG_PROBS], mask, kl_coef, stage.kl_penalty)
    inputs = AdvantageInputs(
        mask=mask, token_rewards=out[F.TOKEN_REWARDS], scores=batch[F.SCORES], values=batch.get(F.VALUES),
        group_ids=batch[F.UID], baseline_scores=batch.get(F.BASELINE_SCORES), gamma=stage.gamma, lam=stage.lam,
        norm_by_std=stage.norm_by_std)
    out[F.ADVANTAGES], out[F.RETURNS] = compute_advantages(stage.estimator, inputs)
    return out, metrics


def token_metrics(batch: Batch, stage: TokenStage) -> dict[str, float]:
    """`batch/tokens` (real tokens, prompts and responses); after an old log-prob pass the policy's entropy,
    its KL to the reference, the sampler-trainer gap (ROLLOUT_LOG_PROBS, which every rollout makes) and the
    correction's weights (`algos.behaviour_metrics`). Without that pass the update reports them."""
    metrics = {"batch/tokens": float(int(batch[F.ATTENTION_MASK].sum()))}
    if not stage.old:
        return metrics
    mask = batch[F.RESPONSE_MASK].bool()
    metrics.update(behaviour_metrics(batch[F.OLD_LOG_PROBS], batch[F.ROLLOUT_LOG_PROBS], mask, stage.correction,
                                     stage.correction_level, stage.correction_threshold))
    metrics["actor/entropy"] = batch[F.ENTROPY][mask].mean().item()
    if stage.reference:
        metrics["actor/kl"] = (batch[F.OLD_LOG_PROBS] - batch[F.REF_LOG_PROBS])[mask].mean().item()
    if F.ROUTE_MISMATCH in batch:  # an MoE rollout's routes, measured in the old pass (engine/routes.py)
        mismatch = batch[F.ROUTE_MISMATCH]
        metrics.update({f"moe/old_pass/{k}": v for k, v in route_metrics(mismatch).items()})
        metrics.update({f"moe/{k}": v for k, v in log_prob_gaps(mismatch, batch[F.OLD_LOG_PROBS],
                                                                 batch[F.ROLLOUT_LOG_PROBS], mask).items()})
    return metrics
