"""HF <-> megatron-core <-> generation names and shapes, one bridge per family.

Three layouts hold the same weights:

- **HF**: `model.layers.N.self_attn.{q,k,v}_proj`, `mlp.{gate,up}_proj`, ...
- **Megatron** (GPTModel with the *local* layer spec, whose norms are separate
  modules): `decoder.layers.N.self_attention.linear_qkv` in Megatron's grouped
  QKV layout, `mlp.linear_fc1` = `[gate; up]`, vocabulary padded to a multiple
  of `make_vocab_size_divisible_by * tp`.
- **generation** (`hybridflow.models.Decoder`): Megatron's fused layout under
  short names, unpadded vocabulary.

The table in `LlamaBridge.entries` is the one place these names meet; loading
checkpoints, the reshard tool and weight sync all go through it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Literal, Optional, Protocol

import torch

from hybridflow.models.config import SUPPORTED_FAMILIES, DecoderConfig, ModelConfigError
from hybridflow.models.sharding import ShardSpec, padded_vocab_size, spec_for

Fuse = Optional[Literal["qkv", "gate_up"]]
# Buffers some HF checkpoints carry that are recomputed, not learned.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ParamEntry:
    megatron: str
    generation: str
    hf: tuple[str, ...]  # HF tensors fused (in order) into this one
    fuse: Fuse = None
    vocab: bool = False  # rows are the vocabulary: padded in the Megatron layout

    @property
    def shard(self) -> ShardSpec:
        return spec_for(self.megatron)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: DecoderConfig) -> torch.Tensor:
    """[q; k; v] (HF) -> Megatron grouped rows [g][q_0..q_{h/g-1}, k, v]; weight or bias."""
    g, hd, rest = cfg.num_kv_heads, cfg.head_dim, q.shape[1:]
    q = q.reshape(g, cfg.heads_per_group * hd, *rest)
    k, v = k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(cfg.qkv_size, *rest)


def split_qkv(qkv: torch.Tensor, cfg: DecoderConfig) -> tuple[torch.Tensor, ...]:
    """Inverse of `fuse_qkv`."""
    g, hd, hpg, rest = cfg.num_kv_heads, cfg.head_dim, cfg.heads_per_group, qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * hd, *rest)
    q, k, v = grouped.split([hpg * hd, hd, hd], dim=1)
    return (q.reshape(g * hpg * hd, *rest).contiguous(), k.reshape(g * hd, *rest).contiguous(),
            v.reshape(g * hd, *rest).contiguous())


class SliceReader(Protocol):
    """Reads (parts of) HF tensors by name: a checkpoint on disk, or a dict in memory."""

    def __call__(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def keys(self) -> list[str]: ...


class LlamaBridge:
    """The Llama family and its relatives share HF names; their differences (QKV bias, QK-norm, experts, and
    Mixtral's `block_sparse_moe` names) are read from `cfg`."""

    def __init__(self, cfg: DecoderConfig, make_vocab_size_divisible_by: int = 128, tp: int = 1):
        self.cfg = cfg
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, make_vocab_size_divisible_by, tp)

    def entries(self) -> list[ParamEntry]:
        cfg = self.cfg
        out = [ParamEntry("embedding.word_embeddings.weight", "embed.weight",
                          ("model.embed_tokens.weight",), vocab=True)]
        for i in range(cfg.num_layers):
            mc, gen, hf = f"decoder.layers.{i}.", f"layers.{i}.", f"model.layers.{i}."
            att = hf + "self_attn."
            out += [
                ParamEntry(mc + "input_layernorm.weight", gen + "attn_norm.weight",
                           (hf + "input_layernorm.weight",)),
                ParamEntry(mc + "self_attention.linear_qkv.weight", gen + "attn.qkv.weight",
                           tuple(f"{att}{p}_proj.weight" for p in "qkv"), fuse="qkv"),
            ]
            if cfg.qkv_bias:
                out.append(ParamEntry(mc + "self_attention.linear_qkv.bias", gen + "attn.qkv.bias",
                                      tuple(f"{att}{p}_proj.bias" for p in "qkv"), fuse="qkv"))
            if cfg.qk_norm:
                out += [ParamEntry(mc + "self_attention.q_layernorm.weight", gen + "attn.q_norm.weight",
                                   (att + "q_norm.weight",)),
                        ParamEntry(mc + "self_attention.k_layernorm.weight", gen + "attn.k_norm.weight",
                                   (att + "k_norm.weight",))]
            out += [
                ParamEntry(mc + "self_attention.linear_proj.weight", gen + "attn.proj.weight",
                           (att + "o_proj.weight",)),
                ParamEntry(mc + "pre_mlp_layernorm.weight", gen + "mlp_norm.weight",
                           (hf + "post_attention_layernorm.weight",)),
            ]
            out += self._moe_entries(mc + "mlp.", gen + "mlp.", hf) if cfg.is_moe else \
                _mlp_entries(mc + "mlp.", gen + "mlp.", hf + "mlp.", ("gate_proj", "up_proj", "down_proj"))
        out.append(ParamEntry("decoder.final_layernorm.weight", "norm.weight", ("model.norm.weight",)))
        if not cfg.tie_word_embeddings:
            out.append(ParamEntry("output_layer.weight", "lm_head.weight", ("lm_head.weight",), vocab=True))
        return out

    def _moe_entries(self, mc: str, gen: str, hf_layer: str) -> list[ParamEntry]:
        """One MoE layer: router, each expert (megatron-core's SequentialMLP names), the shared expert and
        its gate. HF names are those `transformers` writes to disk (one tensor per expert)."""
        cfg = self.cfg
        if cfg.model_type == "mixtral":
            hf, projections = hf_layer + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            hf, projections = hf_layer + "mlp.", ("gate_proj", "up_proj", "down_proj")
        out = [ParamEntry(mc + "router.weight", gen + "router.weight", (hf + "gate.weight",))]
        for j in range(cfg.num_experts):
            out += _mlp_entries(f"{mc}experts.local_experts.{j}.", f"{gen}experts.{j}.", f"{hf}experts.{j}.",
                                projections)
        if cfg.shared_expert_intermediate_size:
            out += _mlp_entries(mc + "shared_experts.", gen + "shared.", hf + "shared_expert.", projections)
            if cfg.shared_expert_gate:
                out.append(ParamEntry(mc + "shared_experts.gate_weight", gen + "shared_gate.weight",
                                      (hf + "shared_expert_gate.weight",)))
        return out

    # -- one tensor ---------------------------------------------------------
    def fuse_parts(self, e: ParamEntry, parts: list[torch.Tensor]) -> torch.Tensor:
        """Entry `e`'s HF tensors (in `e.hf` order) as its one fused tensor; engines loading weights by HF
        name one entry at a time call it too."""
        if e.fuse == "qkv":
            return fuse_qkv(*parts, self.cfg)
        if e.fuse == "gate_up":
            return torch.cat(parts, dim=0)
        return parts[0]

    def fuse_stream(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs in any order -> (generation name, fused tensor), each entry once its last
        part has come. A tied checkpoint's `lm_head.weight` (the embedding again) is skipped; a name no entry
        has is a KeyError naming it, and so are entries left incomplete when `named` ends."""
        entries = {name: e for e in self.entries() for name in e.hf}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            if name not in entries:
                if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                    continue
                raise KeyError(f"weight {name!r} is not a tensor of this {self.cfg.model_type} model")
            e = entries[name]
            parts = pending.setdefault(e.generation, {})
            parts[name] = tensor
            if len(parts) == len(e.hf):
                del pending[e.generation]
                yield e.generation, self.fuse_parts(e, [parts[n] for n in e.hf])
        if pending:
            raise KeyError(f"weights left incomplete: {sorted(pending)[:3]} lack some of their HF parts")

    def split_parts(self, e: ParamEntry, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Inverse of `fuse_parts`: entry `e`'s tensor as its HF tensors, in `e.hf` order."""
        if e.fuse == "qkv":
            return split_qkv(t, self.cfg)
        if e.fuse == "gate_up":
            return tuple(p.contiguous() for p in t.chunk(2, dim=0))
        return (t,)

    def _pad_vocab(self, t: torch.Tensor) -> torch.Tensor:
        extra = self.padded_vocab - t.shape[0]
        return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t

    # -- one rank's slice, read from a checkpoint -----------------------------
    def read_shard(self, e: ParamEntry, read: SliceReader, tp_rank: int, tp: int) -> torch.Tensor:
        """TP rank `tp_rank`'s piece of Megatron tensor `e`, reading only the HF rows/columns it needs.

        read(name, rows=None, cols=None): the HF tensor `name`, or the `slice`
        of its rows / columns (`models.checkpoint.SafetensorsReader` reads
        them with `safe_open(...).get_slice`). Equals
        `shard_tensor(hf_to_megatron(hf)[e.megatron], e.shard, tp_rank, tp)`.
        """
        cfg, spec = self.cfg, e.shard
        if spec.dim is None or tp == 1:
            t = self.fuse_parts(e, [read(n) for n in e.hf])
            return self._pad_vocab(t) if e.vocab else t
        if e.vocab:  # rows [start, stop) of the padded vocabulary
            per = self.padded_vocab // tp
            start, stop = tp_rank * per, (tp_rank + 1) * per
            real = read(e.hf[0], rows=slice(min(start, cfg.vocab_size), min(stop, cfg.vocab_size)))
            return torch.cat([real, real.new_zeros(stop - start - len(real), *real.shape[1:])])
        if spec.dim == 1:  # ROW: input features
            per = read.shape(e.hf[0])[1] // tp
            return read(e.hf[0], cols=slice(tp_rank * per, (tp_rank + 1) * per))
        if e.fuse == "qkv":  # whole query groups: rank r holds groups [r*G/tp, (r+1)*G/tp)
            groups = cfg.num_kv_heads // tp
            g0, g1 = tp_rank * groups, (tp_rank + 1) * groups
            q_rows = slice(g0 * cfg.heads_per_group * cfg.head_dim, g1 * cfg.heads_per_group * cfg.head_dim)
            kv_rows = slice(g0 * cfg.head_dim, g1 * cfg.head_dim)
            q, k, v = (read(n, rows=r) for n, r in zip(e.hf, (q_rows, kv_rows, kv_rows)))
            local = dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=groups)
            return fuse_qkv(q, k, v, local)
        # COLUMN blocks ([gate; up]) or a plain COLUMN tensor: the same rows of each block
        parts = []
        for name in e.hf:
            per = read.shape(name)[0] // tp
            parts.append(read(name, rows=slice(tp_rank * per, (tp_rank + 1) * per)))
        return torch.cat(parts)

    def read_rows(self, e: ParamEntry, read: SliceReader, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the unpadded whole tensor `e` (the generation layout: fused qkv / [gate; up],
        `fuse_parts` of its HF tensors), reading only the HF rows they come from: FSDP's dim-0 chunk of it.
        Equals `fuse_parts(e, [read(n) for n in e.hf])[start:stop]`."""
        if e.fuse is None:
            return read(e.hf[0], rows=slice(start, stop))
        if e.fuse == "gate_up":
            ffn = read.shape(e.hf[0])[0]
            parts = [read(e.hf[0], rows=slice(start, min(stop, ffn))) if start < ffn else None,
                     read(e.hf[1], rows=slice(max(start, ffn) - ffn, stop - ffn)) if stop > ffn else None]
            return torch.cat([p for p in parts if p is not None])
        # qkv: per query group g, [q rows of its heads; k row block; v row block], head_dim rows each
        cfg = self.cfg
        hd, hpg = cfg.head_dim, cfg.heads_per_group
        width = (hpg + 2) * hd  # fused rows per group
        pieces = []
        for g in range(start // width, -(-stop // width)):
            lo, hi = max(start, g * width) - g * width, min(stop, (g + 1) * width) - g * width
            # the group's three blocks: (HF tensor, first HF row, fused offset range)
            for part, base, a, b in ((0, g * hpg * hd, 0, hpg * hd), (1, g * hd, hpg * hd, (hpg + 1) * hd),
                                     (2, g * hd, (hpg + 1) * hd, width)):
                x, y = max(lo, a), min(hi, b)
                if x < y:
                    pieces.append(read(e.hf[part], rows=slice(base + x - a, base + y - a)))
        return torch.cat(pieces)

    def check_hf_names(self, names) -> None:
        """KeyError unless an HF checkpoint with these tensor names is a model of this config."""
        required = {n for e in self.entries() for n in e.hf}
        # Some tied checkpoints still store lm_head; it is the embedding again.
        allowed = required | ({"lm_head.weight"} if self.cfg.tie_word_embeddings else set())
        missing = sorted(required - set(names))
        if missing:
            raise KeyError(f"HF checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        unexpected = sorted(n for n in names if n not in allowed and not n.endswith(_IGNORED_HF_SUFFIXES))
        if unexpected:
            raise KeyError(f"HF checkpoint has {len(unexpected)} unexpected tensor(s), e.g. "
                           f"{unexpected[:3]}: not a {self.cfg.model_type} model of this config?")

    # -- whole state dicts --------------------------------------------------
    def _from_hf(self, hf: dict[str, torch.Tensor], name: Callable[[ParamEntry], str],
                 pad: bool) -> dict[str, torch.Tensor]:
        entries = self.entries()
        self.check_hf_names(hf.keys())
        out = {}
        for e in entries:
            t = self.fuse_parts(e, [hf[n] for n in e.hf])
            out[name(e)] = self._pad_vocab(t) if (pad and e.vocab) else t
        return out

    def _to_hf(self, sd: dict[str, torch.Tensor], name: Callable[[ParamEntry], str],
               partial: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for e in self.entries():
            if name(e) not in sd:
                if partial:  # a part of the model (one pipeline stage)
                    continue
                raise KeyError(f"state dict is missing {name(e)!r}")
            t = sd[name(e)]
            if e.vocab:
                t = t[: self.cfg.vocab_size]
            out.update(zip(e.hf, self.split_parts(e, t)))
        return out

    def hf_to_megatron(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._from_hf(hf, lambda e: e.megatron, pad=True)

    def megatron_to_hf(self, sd: dict[str, torch.Tensor], partial: bool = False) -> dict[str, torch.Tensor]:
        """HF tensors of `sd`; `partial`: convert only the entries present (one pipeline stage's)."""
        return self._to_hf(sd, lambda e: e.megatron, partial)

    def hf_to_generation(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._from_hf(hf, lambda e: e.generation, pad=False)

    def generation_to_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._to_hf(sd, lambda e: e.generation)

    def megatron_to_generation(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename only; vocab rows are sliced (a view), so no weight is copied."""
        return {e.generation: sd[e.megatron][: self.cfg.vocab_size] if e.vocab else sd[e.megatron]
                for e in self.entries()}

    def generation_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the plain decoder's parameters (vocabulary unpadded), built on the meta device."""
        from hybridflow.models.decoder import Decoder

        with torch.device("meta"):
            model = Decoder(self.cfg)
        return {name: tuple(p.shape) for name, p in model.named_parameters()}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of every HF tensor a checkpoint of this config holds (vocabulary unpadded)."""
        gen, out = self.generation_shapes(), {}
        for e in self.entries():
            parts = self.split_parts(e, torch.empty(gen[e.generation], device="meta"))
            out.update((name, tuple(p.shape)) for name, p in zip(e.hf, parts))
        return out

    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (unsharded) shapes of every Megatron parameter."""
        gen = self.generation_shapes()
        return {e.megatron: (self.padded_vocab, *gen[e.generation][1:]) if e.vocab else gen[e.generation]
                for e in self.entries()}


def _mlp_entries(mc: str, gen: str, hf: str, projections: tuple[str, str, str]) -> list[ParamEntry]:
    """A SwiGLU MLP's two tensors; projections: the HF names of its gate, up and down projections."""
    gate, up, down = (f"{hf}{p}.weight" for p in projections)
    return [ParamEntry(mc + "linear_fc1.weight", gen + "fc1.weight", (gate, up), fuse="gate_up"),
            ParamEntry(mc + "linear_fc2.weight", gen + "fc2.weight", (down,))]


BRIDGES: dict[str, type[LlamaBridge]] = {family: LlamaBridge for family in SUPPORTED_FAMILIES}


def get_bridge(cfg: DecoderConfig, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> LlamaBridge:
    if not cfg.native:
        raise ModelConfigError(f"{cfg.why_foreign}: hybridflow's bridge (HF <-> megatron-core <-> decoder names) "
                               f"does not map this model; it runs under transformers only")
    if cfg.model_type not in BRIDGES:
        raise KeyError(f"no bridge for model_type {cfg.model_type!r}; known: {sorted(BRIDGES)}")
    return BRIDGES[cfg.model_type](cfg, make_vocab_size_divisible_by, tp)
