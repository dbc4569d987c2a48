"""The load-balanced sequence split of context parallelism, and its inverse: pure tensor functions.

Under causal attention the last tokens of a sequence attend to the most keys, so a contiguous split
gives the last CP rank most of the work. Megatron (and Transformer Engine's CP attention) cuts every
sequence into 2*cp chunks instead and gives rank r chunks r and 2*cp-1-r: each rank then holds one
early and one late chunk and the same number of query-key pairs. With cp = 2 and 8 tokens:

    chunks   [0 1] [2 3] [4 5] [6 7]
    rank 0   [0 1]             [6 7]   -> positions 0 1 6 7
    rank 1         [2 3] [4 5]         -> positions 2 3 4 5

`cp_split` gives a rank its tokens and their global positions (what its RoPE angles and its causal
mask are computed from); `cp_unsplit` puts the ranks' pieces, in rank order (as an all-gather returns
them), back in sequence order. Nothing here communicates; it is tested without processes.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["cp_gather_order", "cp_positions", "cp_split", "cp_unsplit"]


def _chunk(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2*cp = {2 * cp} equal chunks; "
                         f"pad it to a multiple of {2 * cp}")
    return seq_len // (2 * cp)


def cp_positions(seq_len: int, cp: int, rank: int, device=None) -> Tensor:
    """Global positions [seq_len / cp] (int64) of the tokens CP rank `rank` holds, in the order it holds them."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a CP group of {cp}")
    if cp == 1:  # any length: nothing is cut
        return torch.arange(seq_len, device=device)
    chunk = _chunk(seq_len, cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat((first, last))


def cp_gather_order(seq_len: int, cp: int, device=None) -> Tensor:
    """Global positions [seq_len] of the ranks' tokens concatenated in rank order (an all-gather's order)."""
    return torch.cat([cp_positions(seq_len, cp, r, device) for r in range(cp)])


def cp_split(x: Tensor, cp: int, rank: int, dim: int = 1) -> tuple[Tensor, Tensor]:
    """CP rank `rank`'s share of `x` along `dim` (the sequence: [b, s, ...] by default) and the global
    positions [s / cp] of its tokens. At cp = 1, `x` itself and arange(s)."""
    positions = cp_positions(x.shape[dim], cp, rank, x.device)
    return (x if cp == 1 else x.index_select(dim, positions)), positions


def cp_unsplit(parts: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The inverse of `cp_split`: the pieces of ranks 0..cp-1 (in that order) back in sequence order."""
    cp = len(parts)
    gathered = torch.cat(list(parts), dim)
    if cp == 1:
        return gathered
    order = cp_gather_order(gathered.shape[dim], cp, gathered.device)
    return gathered.index_select(dim, torch.argsort(order))
