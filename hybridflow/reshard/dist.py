"""megatron-core The dist format: megatron-core `dist_checkpointing`, what Megatron-LM's GPTModel saves and loads at any TP/PP.

Such a checkpoint stores every tensor whole (global shapes; each rank of a
saving job wrote its slices), under the keys GPTModel's own
`sharded_state_dict()` gives: layers stacked on a leading axis
(`decoder.layers.mlp.linear_fc2.weight` is [L, H, F]; an MoE layer's experts
on a second axis, [L, E, H, F]), the norms under
Transformer Engine's names, `[gate; up]` as two halves. Rather than copy
those rules, this module asks megatron-core: it builds the model once on the
`meta` device (no memory) at tp = pp = 1 in a world of one process, and fills
or reads the ShardedTensors that model describes.

The only layout-dependent part of the stored tensors is the vocabulary
padding (a multiple of `make_vocab_size_divisible_by * tp`): `--tp` says
which TP the checkpoint is for, and a loader at that TP (or any TP giving the
same padding) takes it. Reading takes one tensor (one layer's slice of a
stacked key) at a time, straight from the chunks the checkpoint's index
lists; writing is one `dist_checkpointing.save` of the whole model, so a
write holds the model in memory (megatron-core's saver takes the state dict
at once).
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Optional

import torch

from hybridflow.models.bridge import get_bridge
from hybridflow.models.config import DecoderConfig
from hybridflow.reshard.base import (EMBEDDING, Format, Item, MegatronReader, Plan, Sink, Source, checked, hf_config,
                                     read_config)

FILE = "(dist_checkpointing)"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _stacked_indices(megatron_name: str) -> tuple[int, ...]:
    """Where a parameter sits in its stacked key: its layer, and an expert's index among the layer's experts
    (megatron-core stacks a layer's experts on a second leading axis)."""
    layer, expert = _LAYER.match(megatron_name), _EXPERT.search(megatron_name)
    return tuple(int(m[1]) for m in (layer, expert) if m is not None)


def holds(path: Path) -> bool:
    """A directory whose metadata.json names a sharded backend (what `dist_checkpointing.save` writes)."""
    meta = path / "metadata.json"
    if not meta.is_file():
        return False
    try:
        return "sharded_backend" in json.loads(meta.read_text())
    except ValueError:
        return False


def open_source(path: Path, role: str, config: Optional[Path]) -> Source:
    return Source(FORMAT, path, read_config(Path(config or path), "SRC config.json"), role=role)


def _meta_sharded_state_dict(cfg: DecoderConfig, padded_vocab: int, dtype: torch.dtype) -> dict:
    """GPTModel's sharded state dict for `cfg` (tp = pp = 1, tensors on `meta`): megatron-core's keys and
    global shapes for this model, keyed by Megatron parameter name."""
    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import cpu_compat
    from hybridflow.engine.build import RopePositions, build_model, transformer_config
    from hybridflow.engine.distributed import init_model_parallel

    if torch.cuda.is_available():
        raise RuntimeError("the dist_checkpointing forms run on the host with megatron-core's CPU layer, which "
                           "needs no visible GPU: run with CUDA_VISIBLE_DEVICES='' (tools/reshard.py sets it)")
    cpu_compat.apply()
    init_model_parallel(ParallelConfig())  # a world of one; refuses to run inside another layout
    tconfig = transformer_config(cfg, ParallelConfig(), dtype, "cpu", False)
    with torch.device("meta"):
        model = build_model(cfg, tconfig, padded_vocab, dtype, torch.device("meta"), RopePositions())
    return dict(model.sharded_state_dict())


def plan_dist(cfg: DecoderConfig, dtype: torch.dtype, tp: int, divisible_by: int) -> Plan:
    """Every Megatron tensor whole, the vocabulary padded as a loader at `tp` pads it."""
    plan = Plan("dist", cfg, dtype, "actor", tp, 1, 1, divisible_by)
    bridge = get_bridge(cfg, divisible_by, tp)
    plan.items = [Item(FILE, name, tuple(shape), name) for name, shape in bridge.megatron_shapes().items()]
    megatron = _meta_sharded_state_dict(cfg, bridge.padded_vocab, dtype)  # refused here, before a write
    missing = [i.name for i in plan.items if i.name not in megatron]
    if missing:
        raise KeyError(f"megatron-core's GPTModel has no {missing[:3]} for this config")
    return plan


def write_dist(plan: Plan, source: Source, reader, out: Path, sink: Sink) -> None:
    """Execute a dist plan into `out`: fill GPTModel's sharded state dict from the source, then one save."""
    from megatron.core import dist_checkpointing

    bridge = get_bridge(plan.cfg, plan.divisible_by, plan.tp)
    entries = {e.megatron: e for e in bridge.entries()}
    sharded = _meta_sharded_state_dict(plan.cfg, bridge.padded_vocab, plan.dtype)
    for item in plan.items:
        tensor = checked(item, bridge.read_shard(entries[item.source], reader, 0, 1), plan.dtype).clone()
        if item.name not in sharded:
            raise KeyError(f"megatron-core's GPTModel has no {item.name!r} for this config")
        sharded[item.name].data = tensor
        sink.wrote(tensor, item.name)
    dist_checkpointing.save(sharded, str(out))
    (out / "config.json").write_text(json.dumps(hf_config(plan), indent=2))


class DistReader(MegatronReader):
    """HF tensors of a dist checkpoint, each Megatron tensor read alone: the chunks of its key (and, for a
    stacked key, of its layer) read from the `.distcp` files by the checkpoint's own index."""

    def __init__(self, source: Source):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = source.path
        self.meta = FileSystemReader(str(source.path)).read_metadata()
        stored = self.meta.state_dict_metadata.get(EMBEDDING)
        if stored is None:
            raise KeyError(f"{source.path}: no {EMBEDDING}: not a GPTModel checkpoint")
        self.dtype = stored.properties.dtype
        self._sharded = _meta_sharded_state_dict(source.cfg, stored.size[0], self.dtype)
        super().__init__(source.cfg, False, self._load_one)

    def _dtype_of(self, megatron_name: str) -> torch.dtype:
        return self.dtype

    def _load_one(self, megatron_name: str) -> torch.Tensor:
        if megatron_name not in self._sharded:
            raise KeyError(f"megatron-core's GPTModel has no {megatron_name!r} for this config")
        key = self._sharded[megatron_name].key
        if key not in self.meta.state_dict_metadata:
            raise KeyError(f"{self.path} holds no {key!r} (for {megatron_name})")
        stored = self.meta.state_dict_metadata[key]
        lead = _stacked_indices(megatron_name) if key != megatron_name else ()
        out = torch.empty(tuple(stored.size)[len(lead):], dtype=stored.properties.dtype)
        for index, chunk in enumerate(stored.chunks):
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            if lead:
                at = tuple(i - o for i, o in zip(lead, offsets))
                if not all(0 <= i < n for i, n in zip(at, sizes)):
                    continue
                piece, offsets, sizes = self._chunk(key, chunk.offsets, index)[at], offsets[len(lead):], sizes[len(lead):]
            else:
                piece = self._chunk(key, chunk.offsets, index)
            out[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = piece
        return out

    def _chunk(self, key: str, offsets, index: int) -> torch.Tensor:
        """One saved chunk, read from its file at its byte range (the saver wrote it with torch.save)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.meta.storage_data[MetadataIndex(key, offsets, index)]
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{self.path}: {key} is stored with transforms {info.transform_descriptors}")
        with open(self.path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        return torch.load(io.BytesIO(data), weights_only=True)


FORMAT = Format("dist", "dist_checkpointing", holds, open_source, DistReader,
                lambda source, req, dtype: plan_dist(source.cfg, dtype, req.tp, req.divisible_by), write_dist,
                lambda req: f"(for tp={req.tp})", tp=True, no_critic="a critic has no megatron-core GPTModel form")
