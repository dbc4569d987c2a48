"""Reductions over the valid (mask == 1) tokens of a [B, T] batch.

They live with the kernels because `masked_whiten` is the reference for the
whitening the C++ GAE scan fuses (`gae.py`), and kernels import nothing from
the layers above them; the algorithms use them through `hybridflow.algos`.

Every function reads padded positions through `torch.where`, never by
multiplying with the mask: padding often holds -inf log-probs or garbage, and
`-inf * 0` is NaN. An empty selection gives 0, not NaN, so a micro-batch made
only of padding cannot poison a step.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def as_bool(mask: Tensor) -> Tensor:
    """A {0,1} float/int/bool mask as a bool tensor."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """`x` where mask is set, exactly 0 elsewhere (also when x is inf/NaN there)."""
    return torch.where(as_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of x[mask] (over `dim`, or over everything when dim is None)."""
    x = masked_fill_zero(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_count(mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Number of valid positions, as float (over `dim`, or in total)."""
    m = as_bool(mask).float()
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of x[mask]; 0 where there is nothing to average.

    x, mask: [B, T]. dim=None -> scalar; dim=-1 -> [B] per-row means.
    """
    count = masked_count(mask, dim).to(x.dtype)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x[mask] (scalar).

    unbiased=True uses Bessel's correction n/(n-1), as torch.var does; with a
    single valid element there is no spread to correct, so it returns 0.
    """
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    n = masked_count(mask).to(x.dtype)
    denom = (n - 1) if unbiased else n
    return sq / denom.clamp(min=1)


def masked_std(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Standard deviation of x[mask] (scalar); see masked_var."""
    return masked_var(x, mask, unbiased).sqrt()


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the valid tokens; 0 at padding.

    x, mask: [B, T] -> [B, T]. Statistics are over all valid tokens of the
    batch (unbiased variance). shift_mean=False only divides by the std, keeping
    the sign of every entry.
    """
    centered = x - masked_mean(x, mask) if shift_mean else x
    return masked_fill_zero(centered * torch.rsqrt(masked_var(x, mask) + eps), mask)
