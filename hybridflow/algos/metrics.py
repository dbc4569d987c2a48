"""Training statistics as plain Python floats under stable names.

The trainer logs these dicts as they are ("actor/clip_frac",
"critic/advantages/mean", ...). Statistics are over valid tokens only; an
empty selection reports 0.0 rather than NaN so a dashboard line never breaks.
The tensor-valued masked reductions live in `kernels/masked.py` and are
re-exported here for convenience.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hybridflow.algos.kl import kl_k3
from hybridflow.algos.losses import clipped_surrogate
from hybridflow.kernels.masked import (as_bool, masked_count, masked_mean, masked_std, masked_var,
                                       masked_whiten)

__all__ = ["clip_fraction", "approx_kl", "entropy_mean", "masked_stats", "advantage_stats",
           "explained_variance", "masked_mean", "masked_var", "masked_std", "masked_whiten"]


@torch.no_grad()
def clip_fraction(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                  clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> float:
    """Fraction of valid tokens where PPO's clipped branch is the active one.

    All inputs [B, T]. A token counts when the clipped term is strictly larger
    (as a loss) than the unclipped one, i.e. its gradient is cut: A > 0 and
    r > 1 + high, or A < 0 and r < 1 - low.
    """
    log_ratio = torch.where(as_bool(mask), log_probs - old_log_probs, torch.zeros_like(log_probs))
    terms = clipped_surrogate(log_ratio.clamp(max=20.0).exp(), advantages, mask,
                              clip_ratio_low, clip_ratio_high)
    return masked_mean(terms.clipped.float(), mask).item()


@torch.no_grad()
def approx_kl(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> float:
    """k3 estimate of KL(pi_old || pi) from the rollout's samples, token mean.

    log_probs, old_log_probs, mask: [B, T]. With r = pi / pi_old per token the
    estimate is (r - 1) - log r: unbiased, never negative, and low-variance
    (Schulman 2020), unlike the plain mean of -log r.
    """
    log_ratio = torch.where(as_bool(mask), log_probs - old_log_probs, torch.zeros_like(log_probs))
    return masked_mean(kl_k3(torch.zeros_like(log_ratio), log_ratio), mask).item()


@torch.no_grad()
def entropy_mean(entropy: Tensor, mask: Tensor) -> float:
    """Mean per-token entropy over valid tokens. entropy, mask: [B, T]."""
    return masked_mean(entropy, mask).item()


@torch.no_grad()
def masked_stats(x: Tensor, mask: Tensor, name: str) -> dict[str, float]:
    """{name/mean, name/max, name/min} of x[mask] (x, mask: [B, T]); 0.0 when empty."""
    m = as_bool(mask)
    if not bool(m.any()):
        return {f"{name}/mean": 0.0, f"{name}/max": 0.0, f"{name}/min": 0.0}
    valid = x[m]
    return {f"{name}/mean": valid.mean().item(), f"{name}/max": valid.max().item(),
            f"{name}/min": valid.min().item()}


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over valid tokens.

    1 is a perfect critic, 0 no better than predicting the mean; negative is
    worse. 0.0 when returns have no variance (nothing to explain).
    """
    var_ret = masked_var(returns, mask).item()
    if masked_count(mask).item() < 2 or var_ret == 0.0:
        return 0.0
    return 1.0 - masked_var(returns - values, mask).item() / var_ret


@torch.no_grad()
def advantage_stats(advantages: Tensor, returns: Tensor, mask: Tensor,
                    values: Optional[Tensor] = None) -> dict[str, float]:
    """mean/max/min of advantages, returns (and values) over valid tokens.

    All inputs [B, T]. Keys: "critic/advantages/{mean,max,min}",
    "critic/returns/...", and with values "critic/values/..." and
    "critic/vf_explained_var".
    """
    stats = {**masked_stats(advantages, mask, "critic/advantages"),
             **masked_stats(returns, mask, "critic/returns")}
    if values is not None:
        stats.update(masked_stats(values, mask, "critic/values"))
        stats["critic/vf_explained_var"] = explained_variance(values, returns, mask)
    return stats
