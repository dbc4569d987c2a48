"""Reduce a per-token loss matrix [B, T] to the scalar that is backpropagated.

The mode decides how much each token weighs: "token-mean" weighs every valid
token equally (long answers dominate), the "seq-mean-*" modes weigh every
sequence equally. Rows without a valid token are left out of sequence means
rather than counted as zero-loss sequences, and an all-padding batch gives a
loss of exactly 0 (with a zero gradient), never NaN.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor

from hybridflow.algos._registry import lookup
from hybridflow.kernels.masked import as_bool, masked_count, masked_sum


def _token_mean(loss_mat: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return masked_sum(loss_mat, mask), masked_count(mask)


def _seq_mean(per_row: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    nonempty = as_bool(mask).any(-1)
    return masked_sum(per_row, nonempty), masked_count(nonempty)


def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1), mask)


def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    row_sum = masked_sum(loss_mat, mask, dim=-1)
    row_mean = row_sum / masked_count(mask, dim=-1).to(row_sum.dtype).clamp(min=1)
    return _seq_mean(row_mean, mask)


# A global count (float or 0-d tensor) replacing the local one; see aggregate_loss.
Denominator = Optional[Union[float, Tensor]]

# mode -> (numerator, natural denominator); split so that `denominator` can
# replace the local count with a global one.
_MODES: dict[str, Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
}
LOSS_AGG_MODES: tuple[str, ...] = tuple(_MODES)


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean",
                   denominator: Denominator = None) -> Tensor:
    """Scalar loss from loss_mat[B, T] over the valid tokens of mask[B, T].

    - "token-mean": sum of valid entries / number of valid tokens.
    - "seq-mean-token-sum": per-row sum, averaged over rows with >= 1 valid token.
    - "seq-mean-token-mean": per-row mean, averaged over rows with >= 1 valid token.

    denominator: when a batch is split over micro-batches or data-parallel
    ranks, pass the global count (valid tokens for token-mean, non-empty rows
    for the seq modes); the summed gradients then equal those of the whole
    batch (where data-parallel gradients are averaged rather than summed,
    scale the loss by the DP size). A float or a 0-d tensor (an all-reduced
    count); None uses this batch's own count. Unknown mode: KeyError.
    """
    numerator, count = lookup(_MODES, mode, "loss_agg_mode")(loss_mat, mask)
    if denominator is None:
        denominator = count
    # A count of 0 only happens when every numerator is 0 too: give 0, not NaN.
    return numerator / torch.as_tensor(denominator, dtype=numerator.dtype).clamp(min=1)
