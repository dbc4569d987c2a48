"""Random inputs for the algos tests: masks with right padding and with holes.

Every mask family includes the edge rows the estimators must survive: a fully
masked row, a length-1 row and a full row.
"""
from __future__ import annotations

import torch

MASK_KINDS = ("right", "holes")


def make_mask(kind: str, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """A float {0,1} mask [batch, length]; rows 0..2 are empty, length-1 and full."""
    if kind == "right":
        lengths = torch.randint(0, length + 1, (batch,), generator=gen)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    elif kind == "holes":
        mask = (torch.rand(batch, length, generator=gen) < 0.6).float()
    else:
        raise ValueError(kind)
    mask[0] = 0.0
    mask[1] = 0.0
    mask[1, length // 2 if kind == "holes" else 0] = 1.0
    mask[2] = 1.0
    return mask


def poison_padding(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    """x with `value` written at padded positions: outputs must not depend on it."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def valid_positions(mask_row: torch.Tensor) -> list[int]:
    return [t for t in range(mask_row.shape[0]) if mask_row[t] != 0]
