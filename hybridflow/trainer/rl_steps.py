"""The stages of one RL iteration as small functions on a batch dict (fields in `data.fields`).

[greedy baseline] -> [reward model] -> [reference log-probs] -> old log-probs -> [values]; what reads the token
tensors (scores on the last token, [KL in reward], advantages, the token figures) runs where the rows are,
`roles.preparation`; the rollout batch itself is assembled by `roles.rollout`, which scores it with the
rule reward (`roles.scoring`). What stays here reads one number a row (scores, lengths, group ids);
the trainer picks which stages run when it is built (rule 7, docs/conventions.md), so none
of these branch on the config.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from hybridflow.algos import group_stats
from hybridflow.algos.advantages import group_index
from hybridflow.data import fields as F

Batch = dict[str, Any]


def env_scores(batch: Batch) -> Tensor:
    """A multi-turn batch's environment rewards per row [B] (their sum over turns); 0 without an environment."""
    return batch[F.ENV_SCORES] if F.ENV_SCORES in batch else torch.zeros(len(batch[F.RESPONSE_LENGTH]))


def rows_off_baseline(batch: Batch) -> Tensor:
    """ReMax: rows of the prompts where some sample scored other than the greedy response (a signal)."""
    off = (batch[F.SCORES].float() - batch[F.BASELINE_SCORES].float()).abs() > 1e-6
    idx, groups = group_index(batch[F.UID])
    return (torch.zeros(groups).index_add_(0, idx, off.float()) > 0)[idx]


def baseline_metrics(batch: Batch, n: int) -> dict[str, float]:
    """ReMax's greedy responses, one per prompt (every n-th row holds its prompt's baseline): their mean
    score `remax/baseline_reward` and share scoring >= 1 `remax/baseline_accuracy`, and the share of samples
    that beat it `remax/above_baseline`."""
    base = batch[F.BASELINE_SCORES].float()
    per_prompt = base[::n]
    return {"remax/baseline_reward": per_prompt.mean().item(),
            "remax/baseline_accuracy": (per_prompt >= 1.0).float().mean().item(),
            "remax/above_baseline": (batch[F.SCORES].float() > base).float().mean().item()}


def nonuniform_rows(batch: Batch) -> Tensor:
    """Rows whose group's scores are not all equal (they carry a learning signal)."""
    stats = group_stats(batch[F.SCORES].float(), batch[F.UID])
    return stats.std > 1e-6


def uniform_rows(batch: Batch, min_score: Optional[float] = None) -> Tensor:
    """Rows whose group's scores are all equal (no signal), and all at least `min_score` if given."""
    out = ~nonuniform_rows(batch)
    if min_score is not None:
        out &= batch[F.SCORES].float() >= min_score
    return out


def rollout_metrics(batch: Batch, prefix: str = "") -> dict[str, float]:
    scores, lengths = batch[F.SCORES].float(), batch[F.RESPONSE_LENGTH].float()
    return {
        f"{prefix}reward/mean": scores.mean().item(),
        f"{prefix}reward/accuracy": (scores >= 1.0).float().mean().item(),
        f"{prefix}response/length_mean": lengths.mean().item(),
        f"{prefix}response/length_max": lengths.max().item(),
        **(env_metrics(batch[F.ENV_STATS], prefix) if F.ENV_STATS in batch else {}),
    }


def env_metrics(stats: list[dict], prefix: str = "") -> dict[str, float]:
    """Multi-turn rollouts: the mean of every count per trajectory (`env/turns_mean`, the environment's
    `env/tool_calls_mean`, ...), the share of trajectories where it is above 0 (`env/tool_calls_rate`), and
    the share ending for each reason (`env/ended_max_turns`, ...)."""
    out: dict[str, float] = {}
    counts = sorted({k for s in stats for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    for key in counts:
        values = [float(s.get(key, 0)) for s in stats]
        out[f"{prefix}env/{key}_mean"] = sum(values) / len(values)
        if key != "turns":  # every trajectory takes a turn
            out[f"{prefix}env/{key}_rate"] = sum(v > 0 for v in values) / len(values)
    for reason in sorted({s.get("ended", "") for s in stats} - {""}):
        out[f"{prefix}env/ended_{reason}"] = sum(s.get("ended") == reason for s in stats) / len(stats)
    return out
