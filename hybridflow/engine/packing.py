"""Row helpers for the engine's forward pass: RL rows rotated, packed or prompt-shared, and back.

RL batches are a left-padded prompt followed by a right-padded response, so
real tokens are one contiguous run per row. Megatron's GPTModel numbers
positions 0..S-1 for every row, so the engine rotates each row to start at
column 0 (`left_align_index`) and rotates the outputs back (`unalign`); with
only right padding left, the plain causal mask is exact. The aligned rows may
then run as one packed row of their real tokens (`pack_rows` /
`unpack_sequences`) or with each shared prompt computed once
(`share_prompt_rows` / `unshare_rows`). Under sequence parallelism every row
is padded on the right to a multiple of tp columns (`pad_columns`). Last, `to_cpu`: what an object
collective may send. Rows are cut or padded in `hybridflow.data.batch`
(pipeline micro-batches: `pad_with_empty_rows`). Pure tensor functions: no
megatron, no process groups.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def left_align_index(attention_mask: Tensor) -> Tensor:
    """Column gather index [B, S] that rotates each row's real tokens to column 0.

    Assumes one contiguous run of real tokens per row (left-padded prompt +
    right-padded response). `x.gather(1, idx)` aligns; `scatter` undoes it.
    """
    s = attention_mask.shape[-1]
    shift = (attention_mask.long().cumsum(-1) == 0).sum(-1, keepdim=True)  # leading pads
    return (torch.arange(s, device=attention_mask.device)[None] + shift) % s


def unalign(x: Tensor, idx: Tensor) -> Tensor:
    """Inverse of `x_aligned = x.gather(1, idx)` for x [B, S, ...]."""
    index = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.empty_like(x).scatter(1, index, x)


def pack_rows(aligned_ids: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Left-aligned rows [b, S] with `lengths` real tokens each -> one packed row of their real tokens.

    Returns ids [1, N] (N = lengths.sum()), position ids [1, N] restarting at 0
    for each sequence, and the attention mask [1, 1, N, N] (True = masked):
    causal within a sequence, nothing across sequences. No padding token is
    computed; attention scores are N x N, of which each sequence uses its block.
    """
    keep = torch.arange(aligned_ids.shape[1], device=aligned_ids.device)[None] < lengths[:, None]
    ids = aligned_ids[keep][None]
    positions = torch.cat([torch.arange(int(n), device=ids.device) for n in lengths])[None]
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths.to(ids.device))
    n = ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    allowed = causal & (segment[:, None] == segment[None, :])
    return ids, positions, ~allowed[None, None]


def unpack_sequences(packed: Tensor, lengths: Tensor, width: int) -> Tensor:
    """Inverse of `pack_rows` for a model output [1, N, ...] -> [b, width, ...], zeros past each length."""
    rows = packed[0].split([int(n) for n in lengths])
    out = packed.new_zeros((len(rows), width, *packed.shape[2:]))
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def share_prompt_rows(aligned_ids: Tensor, lengths: Tensor,
                      prompt_lengths: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Left-aligned rows [b, S] -> one row per distinct prompt: the prompt once, then each of its rows' responses.

    GRPO samples n responses per prompt; run separately, each prompt's tokens
    are computed n times. Here a row's response tokens attend to the one copy
    of its prompt and to their own earlier tokens (never to another
    response), at the positions they have in their own sequence, so every
    output equals the separate rows' up to rounding. Rows share a prompt when
    its tokens are equal, wherever the rows sit in the micro-batch.

    Returns ids [U, L], position ids [U, L], the attention mask [U, 1, L, L]
    (True = masked) and index [b, S]: where each row's aligned column sits in
    the flattened [U * L] outputs, -1 past the row's length.
    """
    b, s = aligned_ids.shape
    device = aligned_ids.device
    col = torch.arange(s, device=device)[None]
    in_prompt = col < prompt_lengths[:, None]
    _, group = torch.unique(aligned_ids.masked_fill(~in_prompt, -1), dim=0, return_inverse=True)
    width: dict[int, int] = {}  # per prompt: slots used so far (its prompt, then its responses so far)
    starts = []
    for g, prompt, total in zip(group.tolist(), prompt_lengths.tolist(), lengths.tolist()):
        start = width.setdefault(g, prompt)
        starts.append(start)
        width[g] = start + total - prompt
    u, L = len(width), max(width.values())
    start = torch.tensor(starts, device=device)[:, None]
    base = group[:, None] * L
    index = torch.where(in_prompt, base + col, base + start + col - prompt_lengths[:, None])
    valid = col < lengths[:, None]
    index = index.masked_fill(~valid, -1)
    slots = index[valid]
    ids = aligned_ids.new_zeros(u * L)
    ids[slots] = aligned_ids[valid]  # a prompt's slots are written by each of its rows, with the same tokens
    positions = torch.zeros(u * L, dtype=torch.long, device=device)
    positions[slots] = col.expand(b, s)[valid]
    owner = torch.full((u * L,), -2, dtype=torch.long, device=device)  # -2 padding, -1 prompt, else the row
    owner[slots] = torch.arange(b, device=device)[:, None].expand(b, s).masked_fill(in_prompt, -1)[valid]
    owner = owner.view(u, L)
    slot = torch.arange(L, device=device)
    allowed = (slot[None, :, None] >= slot[None, None, :]) & (owner[:, None, :] != -2) & (owner[:, :, None] != -2)
    allowed &= (owner[:, None, :] == -1) | (owner[:, None, :] == owner[:, :, None])
    allowed |= torch.eye(L, dtype=torch.bool, device=device)[None]  # a padding slot sees itself: no NaN
    return ids.view(u, L), positions.view(u, L), ~allowed[:, None], index


def padded_width(width: int, multiple: int) -> int:
    """`width` rounded up to a multiple of `multiple`."""
    return -(-width // multiple) * multiple


def pad_columns(ids: Tensor, positions: Tensor, mask: Tensor, multiple: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows ids, positions [b, S] and their attention mask [1 or b, 1, S, S] (True = masked), padded on the
    right to a multiple of `multiple` columns.

    Sequence parallelism splits the sequence dimension evenly over the TP ranks, and megatron-core asserts
    (deep inside a collective) that it divides. No real column attends to a padding column and a padding
    column sees only itself (no all-masked row), so the real columns' outputs are those of the unpadded rows;
    the caller cuts the output back to S columns.
    """
    s = ids.shape[1]
    extra = padded_width(s, multiple) - s
    if extra == 0:
        return ids, positions, mask
    pad = torch.nn.functional.pad
    mask = pad(mask, (0, extra, 0, extra), value=True)
    mask[..., s:, s:] &= ~torch.eye(extra, dtype=torch.bool, device=mask.device)
    return pad(ids, (0, extra)), pad(positions, (0, extra)), mask


def shared_lengths(index: Tensor, rows: int, width: int) -> Tensor:
    """The real columns of each of `share_prompt_rows`' rows [rows, width] (its prompt and its responses, from
    column 0), from its `index`."""
    used = torch.zeros(rows * width, dtype=torch.bool, device=index.device)
    used[index[index >= 0]] = True
    return used.view(rows, width).sum(-1)


def unshare_rows(output: Tensor, index: Tensor) -> Tensor:
    """Inverse of `share_prompt_rows` for a model output [U, L, ...] -> [b, S, ...], zeros past each length.
    A prompt's outputs go to each of its rows (the gather's backward sums their gradients)."""
    flat = output.reshape(-1, *output.shape[2:])
    out = flat[index.clamp(min=0)]
    return out.masked_fill((index < 0).view(*index.shape, *([1] * (out.dim() - 2))), 0)


def to_cpu(value: Any) -> Any:
    """`value` with every tensor in it on the CPU: what an object collective may send.

    `broadcast_object_list` rebuilds a CUDA tensor on the *sender's* device
    index, so under torchrun (one process per GPU) a receiver would fill
    another rank's GPU; a CPU copy lands where the receiver puts it.
    """
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
