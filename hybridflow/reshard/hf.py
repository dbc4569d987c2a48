"""The HF format: a directory with `model.safetensors`, or shards listed by `model.safetensors.index.json`.

Read with `safe_open(...).get_slice`, one mapping per read (`SafetensorsFiles`). Written by hand, header
first (the plan knows every shape and offset), then each tensor's bytes as it is read: one tensor in memory.
Split into `model-0000i-of-0000n.safetensors` with an index past `max_shard_bytes`, as `transformers` writes
them. A critic is a one-label `...ForTokenClassification` (`score.weight`, no lm_head).
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open

from hybridflow.checkpoint.format import VALUE_HEAD
from hybridflow.errors import ConfigError
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import INDEX_FILE, SINGLE_FILE, SafetensorsReader, check_hf_checkpoint
from hybridflow.models.config import DecoderConfig, ModelConfigError
from hybridflow.reshard.base import (DTYPES, Format, Item, Plan, Sink, Source, checked, hf_config, hf_names,
                                     read_config, tensor_for)

_ST_DTYPES = {dtype: name for name, dtype in DTYPES.items()}


# --- reading -----------------------------------------------------------------

def holds(path: Path) -> bool:
    return (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()


def open_source(path: Path, role: str, config: Optional[Path]) -> Source:
    """An HF checkpoint, its tensors checked against its config (headers only) before anything is written;
    role critic from an LM: a critic whose value head starts fresh."""
    cfg = read_config(Path(config or path), "SRC config.json")
    if _is_critic(path):
        return Source(FORMAT, path, cfg, role="critic")
    try:
        check_hf_checkpoint(path, cfg)
    except ModelConfigError as exc:
        raise ConfigError("SRC", str(exc)) from None
    return Source(FORMAT, path, cfg, role=role)


def _is_critic(path: Path) -> bool:
    """An HF directory written from a critic: a one-label token classifier (`score.weight`, no lm_head)."""
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(a).endswith("ForTokenClassification") for a in archs)


class SafetensorsFiles:
    """An HF checkpoint read a slice at a time (`bridge.SliceReader`), each read through its own
    `safe_open(...).get_slice`, closed right after: the pages of a memory-mapped file that a read touches
    count in the process's resident memory while the file stays mapped, so a reader that kept every file
    open (`models.checkpoint.SafetensorsReader`) would end a conversion holding the whole model there."""

    def __init__(self, path: Path):
        self.path = path
        self._where: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for file in SafetensorsReader(path).files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    self._where[name], self._shapes[name] = str(file), tuple(part.get_shape())
                    self._dtypes[name] = part.get_dtype()

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise KeyError(f"HF checkpoint {self.path} has no tensor {name!r}")
        return self._shapes[name]

    def stored_dtype(self, name: str) -> torch.dtype:
        self.shape(name)
        if self._dtypes[name] not in DTYPES:
            raise ConfigError("SRC", f"{name} is stored as {self._dtypes[name]}; the tool converts F32, BF16, F16")
        return DTYPES[self._dtypes[name]]

    def __call__(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        self.shape(name)
        with safe_open(self._where[name], framework="pt") as f:
            part = f.get_slice(name)
            if rows is None and cols is None:
                return part[:]
            return part[rows] if cols is None else part[rows or slice(None), cols]

    def __enter__(self) -> "SafetensorsFiles":
        return self

    def __exit__(self, *exc) -> None:
        pass


# --- writing -----------------------------------------------------------------

def plan_hf(cfg: DecoderConfig, dtype: torch.dtype, role: str, max_shard_bytes: int) -> Plan:
    """HF safetensors: the bridge's HF tensors in order, cut into files of at most `max_shard_bytes`."""
    plan = Plan("hf", cfg, dtype, role)
    shapes = get_bridge(cfg).hf_shapes()
    shapes[VALUE_HEAD] = (1, cfg.hidden_size)
    groups: list[list[str]] = [[]]
    size = 0
    for name in hf_names(cfg, role == "critic"):
        nbytes = math.prod(shapes[name]) * dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    for i, names in enumerate(groups, start=1):
        file = SINGLE_FILE if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        plan.items += [Item(file, n, tuple(shapes[n]), n) for n in names]
    return plan


def write_safetensors(path: Path, items: list[Item], dtype: torch.dtype,
                      tensors: Iterable[torch.Tensor]) -> None:
    """A safetensors file written as its tensors arrive: header from the plan, then the bytes in order."""
    header, offset = {}, 0
    for i in items:
        size = math.prod(i.shape) * dtype.itemsize
        header[i.name] = {"dtype": _ST_DTYPES[dtype], "shape": list(i.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the format's own writer keeps it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for item, t in zip(items, tensors, strict=True):
            f.write(memoryview(checked(item, t, dtype).view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())


def write_hf(plan: Plan, source: Source, reader, out: Path, sink: Sink) -> None:
    """Execute an HF plan into the directory `out` (config.json, safetensors, the index when sharded)."""
    files = plan.files()
    for file, items in files.items():
        def each(items=items):
            for item in items:
                t = tensor_for(plan, item, reader)
                yield t
                sink.wrote(t, item.name)
        write_safetensors(out / file, items, plan.dtype, each())
    if len(files) > 1:
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": {i.name: i.file for i in plan.items}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config = hf_config(plan)
    if plan.role == "critic":  # a one-label token classifier: what `transformers` loads a value model as
        config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "ForTokenClassification")]
        config["num_labels"] = 1
        config["token_classification_bias"] = False  # the value head has none (transformers' default adds one)
    (out / "config.json").write_text(json.dumps(config, indent=2))


FORMAT = Format("hf", "HF", holds, open_source, lambda source: SafetensorsFiles(source.path),
                lambda source, req, dtype: plan_hf(source.cfg, dtype, source.role, req.max_shard_bytes),
                write_hf, lambda req: "(whole tensors)")
