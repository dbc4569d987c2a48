"""A plain decoder-only transformer for the Llama family and its relatives (Qwen2, Mistral, Qwen3, and the
mixture-of-experts Qwen3-MoE, Mixtral and Qwen2-MoE).

Used for generation and as a reference forward. It keeps the *fused* weight
layout of megatron-core rather than HF's separate projections:

- `attn.qkv` is Megatron's grouped layout: rows are ordered per query group
  `[q_0 .. q_{h/g-1}, k, v]` (head_dim rows each), so a contiguous row slice
  is exactly one tensor-parallel shard;
- `mlp.fc1` is `[gate; up]`; an MoE layer's `mlp.experts[j].fc1` too, one module per expert (as
  megatron-core's SequentialMLP holds them), so generation weights stay views of training ones.

With the same layout, the generation weights can be views of the training
engine's parameters (no copy), which is what the 3D-HybridEngine builds on.

Tensor parallelism is injected, not built in (rule 1, docs/conventions.md):
`Decoder(cfg, parallel)` takes a `TensorParallel` context, `NO_PARALLEL` by
default. With a group of `size > 1` the model holds rank `rank`'s shard of
each weight (whole query groups, `[gate_r; up_r]`, a slice of the padded
vocabulary), and the context's two collectives do the rest: a sum after the
row-parallel projections and the vocab-parallel embedding, and a gather of
the vocabulary slices of the logits. Nothing here imports torch.distributed.
"""
from __future__ import annotations

import math
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.config import DecoderConfig, ModelConfigError
from hybridflow.models.kv_cache import KVCache


class TensorParallel(Protocol):
    """Where a model sits in a tensor-parallel group, and the group's two collectives."""

    rank: int
    size: int
    padded_vocab: int  # vocabulary rows over the whole group (a multiple of size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group (in place allowed)."""

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """The group's last-dim slices of `x`, concatenated in rank order."""


class _NoParallel:
    """A group of one: every collective is the identity."""

    rank, size, padded_vocab = 0, 1, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        return x


NO_PARALLEL = _NoParallel()


def local_config(cfg: DecoderConfig, size: int) -> DecoderConfig:
    """The shapes one rank of a `size`-way TP group holds: its heads, KV heads and MLP slice."""
    if size == 1:
        return cfg
    import dataclasses

    for what, n in [("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads), *cfg.mlp_splits]:
        if n % size:
            raise ValueError(f"a {size}-way tensor-parallel group cannot split {n} {what}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                               intermediate_size=cfg.intermediate_size // size if not cfg.is_moe
                               else cfg.intermediate_size,
                               moe_intermediate_size=cfg.moe_intermediate_size // size,
                               shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the gain, as HF does, so
        # bfloat16 outputs match bit for bit.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with linear or llama3 scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos/sin [B, T, 1, 1, head_dim] for integer positions [B, T] (broadcast over groups, heads)."""
    freqs = position_ids[..., None, None, None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, groups, heads, head_dim] by the half-split convention HF uses."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Self-attention over this rank's query groups (cfg: the local config)."""

    def __init__(self, cfg: DecoderConfig, layer: int, parallel: TensorParallel = NO_PARALLEL):
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        self.layer = layer  # its slot in a KVCache
        self.qkv = nn.Linear(cfg.hidden_size, cfg.qkv_size, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def rotate_qk(self, qkv: torch.Tensor, cos, sin) -> torch.Tensor:
        """Each group's queries and key [B, T, groups, heads_per_group + 1, head_dim], QK-normed (where the
        family has it) and rotated, from the grouped qkv [B, T, groups, heads_per_group + 2, head_dim]."""
        hpg = self.cfg.heads_per_group
        if not self.cfg.qk_norm:
            return apply_rope(qkv[:, :, :, :hpg + 1], cos, sin)
        qk = torch.cat([self.q_norm(qkv[:, :, :, :hpg]), self.k_norm(qkv[:, :, :, hpg:hpg + 1])], dim=3)
        return apply_rope(qk, cos, sin)

    def forward(self, x, cos, sin, mask, cache: Optional[KVCache] = None):
        cfg = self.cfg
        b, t, _ = x.shape
        hpg, hd = cfg.heads_per_group, cfg.head_dim
        # [B, T, groups, heads_per_group + 2, head_dim]: Megatron's grouped layout.
        qkv = self.qkv(x).view(b, t, -1, hpg + 2, hd)
        qk = self.rotate_qk(qkv, cos, sin)  # queries and key of each group at once
        k = qk[:, :, :, hpg].transpose(1, 2)
        v = qkv[:, :, :, hpg + 1].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if t == 1:
            # One query per head (a decode step): a group's heads are the query
            # rows of its one kv head, so keys are never expanded or copied.
            out = F.scaled_dot_product_attention(qk[:, 0, :, :hpg], k, v, attn_mask=mask)
            return self.parallel.all_reduce(self.proj(out.reshape(b, 1, -1)))
        q = qk[:, :, :, :hpg].reshape(b, t, -1, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hpg > 1)
        return self.parallel.all_reduce(self.proj(out.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    """SwiGLU over this rank's slice of the hidden features (cfg: the local config)."""

    def __init__(self, cfg: DecoderConfig, parallel: TensorParallel = NO_PARALLEL, features: Optional[int] = None):
        super().__init__()
        self.parallel = parallel
        features = features or cfg.intermediate_size
        self.fc1 = nn.Linear(cfg.hidden_size, 2 * features, bias=False)  # [gate; up]
        self.fc2 = nn.Linear(features, cfg.hidden_size, bias=False)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (before the sum over the TP group)."""
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.partial(x))


class MoE(nn.Module):
    """Experts in place of the MLP (cfg: the local config; each expert holds this rank's feature slice).

    The router is a softmax over the experts' logits, the top `moe_top_k` kept per token (their weights
    renormalised when `moe_norm_topk_prob`). Tokens are grouped by expert, and each expert computes its
    rows in one matmul pair. `routes_out`: a list while the generator records routes (`rollout/routes.py`),
    each routing appending its own choice [tokens, k]; `routes_in` [tokens, k]: experts to route by instead
    (a row of -1: its own), weighted by the router's probabilities at them (routing replay's reference).
    """

    def __init__(self, cfg: DecoderConfig, parallel: TensorParallel = NO_PARALLEL):
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, parallel, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))
        self.shared = (MLP(cfg, parallel, cfg.shared_expert_intermediate_size)
                       if cfg.shared_expert_intermediate_size else None)
        self.shared_gate = (nn.Linear(cfg.hidden_size, 1, bias=False)
                            if self.shared is not None and cfg.shared_expert_gate else None)
        self.routes_out: Optional[list[torch.Tensor]] = None
        self.routes_in: Optional[torch.Tensor] = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, k] in x's dtype, experts [N, k] int64)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.cfg.moe_top_k, dim=-1)
        if self.routes_out is not None:
            self.routes_out.append(experts)
        if self.routes_in is not None:
            forced = self.routes_in.to(experts.device).long()
            experts = torch.where((forced >= 0).all(-1, keepdim=True), forced, experts)
            weights = probs.gather(1, experts)
        if self.cfg.moe_norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // experts.shape[1]  # the token of each (token, slot) pair, grouped by expert
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                pairs = order[start:start + count]
                y = expert.partial(x[rows[start:start + count]])
                out.index_add_(0, rows[start:start + count], y * weights.reshape(-1)[pairs, None])
            start += count
        return self.parallel.all_reduce(self._add_shared(x, out)).reshape(shape)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` with every expert run on every token and unchosen ones weighted 0: shapes do not
        depend on the routes (no host sync), as a captured CUDA graph needs. The sum runs in the same
        expert order, so a token's output differs from `forward`'s only by the matmul's rounding."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        combine = torch.zeros(x.shape[0], self.cfg.num_experts, dtype=x.dtype, device=x.device)
        combine.scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for j, expert in enumerate(self.experts):
            out = out + expert.partial(x) * combine[:, j:j + 1]
        return self.parallel.all_reduce(self._add_shared(x, out)).reshape(shape)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            return out
        y = self.shared.partial(x)
        return out + (y * torch.sigmoid(self.shared_gate(x)) if self.shared_gate is not None else y)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, parallel: TensorParallel = NO_PARALLEL):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, parallel)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, parallel) if cfg.is_moe else MLP(cfg, parallel)

    def forward(self, x, cos, sin, mask, cache: Optional[KVCache] = None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


def build_attention_mask(attention_mask: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask: causal, key padding, optional sliding window.

    A padded query position would otherwise attend to nothing (NaN from the
    softmax); it is allowed to see itself, and its output is ignored anyway.
    """
    t = attention_mask.shape[-1]
    device = attention_mask.device
    idx = torch.arange(t, device=device)
    allowed = idx[None, :] <= idx[:, None]
    if window is not None:
        allowed &= idx[:, None] - idx[None, :] < window
    allowed = allowed[None] & attention_mask[:, None, :].bool()
    allowed |= torch.eye(t, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0-based positions counting only real tokens (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class Decoder(nn.Module):
    """Llama-family causal LM (dense or mixture-of-experts). `forward(input_ids[B,T]) -> logits[B,T,V]`.

    parallel: a tensor-parallel context (`NO_PARALLEL`: the whole model).
    `cfg` is then this rank's local config (its heads, KV heads, MLP slice;
    a KVCache built from it holds its KV heads); `full_cfg` the model's.
    Logits are always the whole, unpadded vocabulary, on every rank.
    """

    def __init__(self, cfg: DecoderConfig, parallel: TensorParallel = NO_PARALLEL):
        super().__init__()
        if not cfg.native:
            raise ModelConfigError(f"{cfg.why_foreign}: hybridflow's decoder does not build this model (it runs "
                                   f"under transformers only)")
        self.full_cfg, self.parallel = cfg, parallel
        self.cfg = local_config(cfg, parallel.size)
        rows = cfg.vocab_size if parallel.size == 1 else parallel.padded_vocab // parallel.size
        self.embed = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(self.cfg, i, parallel) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, rows, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def init_weights(self, std: float = 0.02, seed: Optional[int] = None) -> "Decoder":
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None,
                      allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden] (input to the output layer).

        allowed: an explicit boolean [B or 1, 1, T, T] mask (True = may attend) for every layer instead of
        the causal one built from `attention_mask`: packed or prompt-shared rows (`engine/packing.py`),
        whose sequences must not see each other; full attention layers only (it carries no window).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, x.dtype)
        if allowed is not None:
            masks = {w: allowed for w in set(self.cfg.layer_windows)}
        else:
            masks = {w: build_attention_mask(attention_mask, w) for w in set(self.cfg.layer_windows)}
        for layer, window in zip(self.layers, self.cfg.layer_windows):
            x = layer(x, cos, sin, masks[window])
        return self.norm(x)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; with TP, each rank looks up the ids in its vocabulary slice and the group sums."""
        if self.parallel.size == 1:
            return self.embed(input_ids)
        rows = self.embed.num_embeddings
        local = input_ids - self.parallel.rank * rows
        outside = (local < 0) | (local >= rows)
        x = self.embed(local.masked_fill(outside, 0)).masked_fill(outside[..., None], 0.0)
        return self.parallel.all_reduce(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output layer: [.., hidden] -> [.., vocab], gathered over the TP group, padding dropped."""
        # The module's own call where there is one (not the embedding's tied weight): a wrapper that hooks
        # modules (FSDP2 gathering lm_head as a unit of its own) sees the output layer run.
        out = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.embed.weight)
        if self.parallel.size == 1:
            return out
        return self.parallel.gather_vocab(out)[..., :self.full_cfg.vocab_size]

    def forward(self, input_ids, attention_mask=None, position_ids=None,
                allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, attention_mask, position_ids, allowed))

    def forward_cached(self, input_ids, cache: KVCache, attention_mask=None,
                       last_only: bool = False) -> torch.Tensor:
        """Logits [b, t, V] (or [b, 1, V]) of `input_ids` [b, t] following what `cache` holds.

        Keys and values are appended to `cache`, positions continue from each
        row's real tokens so far; `attention_mask` [b, t] (default all ones)
        marks left padding. On an empty cache `b` may divide the cache batch
        (prefill a prompt once for several rows, see `KVCache.append`).
        """
        position_ids = cache.append(input_ids.shape[1], attention_mask)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, x.dtype)
        windows = set(self.cfg.layer_windows)
        if cache.start == 0:  # nothing cached before: attend among the new tokens only
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            masks = {w: build_attention_mask(attention_mask, w) for w in windows}
        else:
            masks = {w: cache.attention_mask(w) for w in windows}
        for layer, window in zip(self.layers, self.cfg.layer_windows):
            x = layer(x, cos, sin, masks[window], cache)
        h = self.norm(x[:, -1:] if last_only else x)
        return self.logits(h)
