"""Core attention at context parallelism > 1 without Transformer Engine.

megatron-core's local `DotProductAttention` asserts cp == 1: its CP attention is Transformer Engine's.
Where TE is missing (every CPU run) the engine's local layer spec takes `CpDotProductAttention` instead
(`core_attention_for`). Each CP rank holds chunks r and 2*cp-1-r of every sequence
(`hybridflow.parallel.cp_split`); the module

- all-gathers K and V over the CP group (`gather_sequence`: backward reduce-scatters their gradients,
  so each rank gets the sum over every rank's queries of its own keys' gradients) and puts them in
  sequence order;
- masks by global position: causal, the model's sliding window, and the caller's mask if any (the
  full [b or 1, 1, S, S] mask the cp = 1 path would get; this rank's rows are taken). Unlike the
  local path, which replaces the caller's mask by the window mask, the three are combined;
- repeats KV heads for GQA and computes scale, mask and softmax as the local path does (float32
  softmax for half inputs, masked scores -10000).

Simplified against TE's ring attention: every rank holds all S keys and values (as at cp = 1) and
an [S/cp, S] score matrix (1/cp of cp = 1's); the all-gather moves (cp-1)/cp of K and V once per
layer, not overlapped with compute. Fine for the sequence lengths RL on CPU runs; a ring that overlaps
the exchange with compute is TE's job on GPU.

RoPE at the chunks' global positions is `build.RopePositions`' part (it takes the rotary module's
angles at `cp_positions`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.parallel.cp_split import cp_gather_order, cp_positions, cp_split, cp_unsplit

__all__ = ["CpDotProductAttention", "core_attention_for", "gather_output", "gather_sequence"]


class _GatherSequence(torch.autograd.Function):
    """[s, ...] on each rank -> [cp * s, ...], rank order; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_sequence(x: Tensor, group) -> Tensor:
    """All-gather `x` [s, ...] over `group` along dim 0 (rank order), differentiably."""
    return _GatherSequence.apply(x, group)


class _GatherOutput(torch.autograd.Function):
    """The model's output for this rank's tokens [b, s/cp, ...] -> the whole sequence [b, s, ...] in order,
    on every CP rank; backward: this rank's tokens' slice of the gradient, not a sum, because every CP
    rank computes the same loss from the same gathered output (megatron-core's schedule multiplies it
    by cp and DDP averages over dp x cp, which together give the one-rank gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return cp_unsplit(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.index_select(1, cp_positions(grad.shape[1], cp, rank, grad.device)), None


def gather_output(x: Tensor, group) -> Tensor:
    """This CP rank's model output [b, s/cp, ...] -> [b, s, ...] in sequence order (see `_GatherOutput`)."""
    return _GatherOutput.apply(x, group)


def _window_of(config, layer_number: int) -> Optional[tuple[int, int]]:
    from megatron.core.transformer.utils import is_layer_window_attention

    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return config.window_size
    return None


class CpDotProductAttention(torch.nn.Module):
    """`DotProductAttention`'s place in the local layer spec at cp > 1 (same constructor and forward).

    query [sq, b, np, hn], key and value [sq, b, ng, hn]: this rank's tokens (`cp_positions` order) ->
    context [sq, b, np * hn]. `attention_mask`: None (causal) or the full-sequence bool mask
    [b or 1, 1, S, S], True where a query may not see a key, as the cp = 1 path takes it.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__()
        from megatron.core import parallel_state as ps

        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"CP attention without TE has no {config.softmax_type!r} softmax")
        self.config = config
        self.layer_number = max(1, layer_number)
        tp = ps.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.cp_group = ps.get_context_parallel_group()
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels)) if softmax_scale is None else softmax_scale
        self.coeff = None
        if config.apply_query_key_layer_scaling:  # as DotProductAttention: scores / layer, softmax * layer
            self.coeff = self.layer_number
            self.softmax_scale /= self.coeff
        self.window = _window_of(config, layer_number)
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

    def _mask(self, q_pos: Tensor, seq_len: int, attention_mask: Optional[Tensor]) -> Tensor:
        """True where a query (global positions q_pos [sq]) may not see a key (positions 0..S-1): [.., sq, S]."""
        k_pos = torch.arange(seq_len, device=q_pos.device)
        offset = q_pos[:, None] - k_pos[None, :]
        masked = offset < 0
        if self.window is not None:  # (left, right) as megatron's sliding-window mask
            masked = masked | (offset > self.window[0]) | (offset < -self.window[1])
        if attention_mask is not None:
            if attention_mask.shape[-2:] != (seq_len, seq_len):
                raise ValueError(f"CP attention takes the full-sequence mask [.., {seq_len}, {seq_len}]; "
                                 f"got {tuple(attention_mask.shape)}")
            masked = masked | attention_mask.index_select(-2, q_pos).bool()
        return masked

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("CP attention without TE takes no packed sequences or attention bias")
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        sq, b = query.shape[:2]
        seq_len = sq * cp
        # All keys and values, back in sequence order: key j sits at row j.
        order = torch.argsort(cp_gather_order(seq_len, cp, query.device))
        key = gather_sequence(key, self.cp_group).index_select(0, order)
        value = gather_sequence(value, self.cp_group).index_select(0, order)
        if self.heads > self.groups:  # GQA: each KV head serves heads / groups query heads
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        # [sq, b, np, hn] -> [b * np, sq, hn], as DotProductAttention computes its scores
        q = query.reshape(sq, b * self.heads, -1).transpose(0, 1)
        k = key.reshape(seq_len, b * self.heads, -1).transpose(0, 1)
        scores = torch.baddbmm(q.new_empty(b * self.heads, sq, seq_len), q, k.transpose(1, 2),
                               beta=0.0, alpha=self.softmax_scale).view(b, self.heads, sq, seq_len)
        half = scores.dtype in (torch.float16, torch.bfloat16)
        if half and self.config.attention_softmax_in_fp32:
            scores = scores.float()
        if self.coeff is not None:
            scores = scores * self.coeff
        mask = self._mask(cp_positions(seq_len, cp, rank, query.device), seq_len, attention_mask)
        probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1).to(query.dtype)
        probs = self.dropout(probs)
        v = value.reshape(seq_len, b * self.heads, -1).transpose(0, 1)
        context = torch.bmm(probs.view(b * self.heads, sq, seq_len), v)  # [b * np, sq, hn]
        return context.view(b, self.heads, sq, -1).permute(2, 0, 1, 3).reshape(sq, b, -1)


def core_attention_for(tconfig, device: str):
    """The core-attention module for the local layer spec: None keeps megatron-core's (cp = 1);
    Transformer Engine's where it is installed and the run is on GPU (not run on these CPU machines);
    else `CpDotProductAttention`."""
    if tconfig.context_parallel_size == 1:
        return None
    if device != "cpu":
        try:
            from megatron.core.extensions.transformer_engine import TEDotProductAttention
            return TEDotProductAttention
        except ImportError:
            pass
    return CpDotProductAttention


def context_parallel_forward(model, ids: Tensor, cp: int, rank: int, width: int, real: Tensor, tconfig) -> Tensor:
    """The output [b, s, ...] of left-aligned rows `ids` [b, s] (`real[b]` tokens each) at cp > 1, on every CP
    rank (`rank`: this one).

    Rows are padded at the end to `width` (the engine's pipeline width: a multiple of 2*cp, times tp under
    sequence parallelism; causal attention keeps the padding out of every real token's view); the rank runs
    its load-balanced chunks (`cp_split`) against the full causal mask, which its CP attention takes its
    queries' rows of; the outputs are gathered back in order. An MoE model's routers are told which of the
    chunks' columns are padding (`engine/moe.padding_kwargs`), as at cp = 1.
    """
    from hybridflow.engine.moe import padding_kwargs
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    s = ids.shape[1]
    ids = torch.nn.functional.pad(ids, (0, width - s))
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=ids.device), 1)[None, None]
    local, positions = cp_split(ids, cp, rank)
    padding = positions[None].to(ids.device) >= real.to(ids.device)[:, None]
    output = model(local, positions[None].expand_as(local), causal, **padding_kwargs(model, padding, tconfig))
    # A chunk that is not the model's last (at virtual_pp > 1 every chunk but the last pipeline rank's
    # last one, though that rank is "the last stage") sends its activations of its chunks onwards.
    if not get_attr_wrapped_model(model, "post_process"):
        return output
    return gather_output(output, ps.get_context_parallel_group())[:, :s]
