"""DAPO's two length rules (Yu et al. 2025, arXiv 2503.14476, section 3.4) as pure functions of per-row tensors.

A response that runs into the length limit is usually cut mid-thought: scoring it as a plain wrong answer
punishes reasoning that may have been sound, and that noise is what both rules address. Soft overlong
punishment lowers the reward of responses that come close to the limit, in proportion to how close; overlong
filtering (the trainer's `algorithm.mask_truncated`) takes the responses the limit cut out of the loss.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty: float) -> Tensor:
    """The reward to add to each response [B] (<= 0) from its length in tokens [B].

    0 while L <= max_length - buffer; then -penalty * (L - (max_length - buffer)) / buffer, reaching -penalty
    at L = max_length (and held there beyond it). ValueError unless 0 < buffer <= max_length.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"the overlong buffer must be 1..{max_length} tokens (the length limit), got {buffer}")
    over = (lengths.float() - (max_length - buffer)).clamp(min=0, max=buffer)
    return -penalty * over / buffer


def truncated_rows(responses: Tensor, mask: Tensor, max_new_tokens: int, stop_ids: Sequence[int]) -> Tensor:
    """Which responses [B, R] (their generated tokens marked in mask [B, R]) the limit cut [B] bool: those
    that hold max_new_tokens tokens and whose last one is not a stop token. A row ended by a stop string
    on its very last allowed token counts as cut (the token ids do not show the string)."""
    m = mask.bool()
    full = m.sum(-1) >= max_new_tokens
    last = torch.where(m, torch.arange(m.shape[-1], device=m.device), -1).amax(-1).clamp(min=0)
    tokens = responses.gather(-1, last[:, None]).squeeze(-1)
    stopped = torch.isin(tokens, torch.as_tensor(tuple(stop_ids), dtype=tokens.dtype, device=tokens.device))
    return full & ~stopped
