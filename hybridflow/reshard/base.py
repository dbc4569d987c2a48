"""What every format of the reshard tool shares: the `Format` record, a source as HF tensors read one at a
time, and the output planned as data (rule 3), then written tensor by tensor.

Every source, whatever its format and layout, is opened as a
`bridge.SliceReader` in HF names: the bridge's `read_shard` then cuts any
target TP shard out of it, and a writer copies it tensor by tensor. So the
sharding rules live only in `models/sharding.py` and the name mapping only in
`models/bridge.py`; the readers only find tensors. A `Plan` is every file of
the output, the tensors in it, their shapes and bytes, and where each comes
from (an HF name of the source, or a Megatron name cut to a TP rank by the
bridge); the dry run prints it, and a format's `write` executes it through a
`Sink` that counts bytes and draws the progress bar.

A Megatron-layout source (`MegatronReader`) keeps the last whole tensor it
assembled, so the three HF tensors of one fused QKV (or the two of
`[gate; up]`) cost one assembly; peak memory stays near the largest tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hybridflow.checkpoint.format import OUTPUT_LAYER, VALUE_HEAD
from hybridflow.errors import ConfigError
from hybridflow.models.bridge import ParamEntry, get_bridge
from hybridflow.models.config import DecoderConfig, ModelConfigError
from hybridflow.parallel.layout import ParallelDims
from hybridflow.parallel.stages import local_name as stages_local_name
from hybridflow.parallel.stages import param_stage

EMBEDDING = "embedding.word_embeddings.weight"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class Format:
    """One checkpoint format: how to find it, read it and write it (`formats.FORMATS` holds them all).

    `req` below is the command line's `convert.Request`; `reader` a source's open `SliceReader`.
    """

    name: str  # what --to takes
    label: str  # how its messages name it
    holds: Callable[[Path], bool]  # whether a directory is a checkpoint of this format
    source: Callable[[Path, str, Optional[Path]], "Source"]  # (path, role, config) -> the checkpoint to read
    reader: Callable[["Source"], Any]  # an open HF-name SliceReader over it (a context manager)
    plan: Callable[["Source", Any, torch.dtype], "Plan"]  # (source, req, dtype) -> the output, as data
    write: Callable[["Plan", "Source", Any, Path, "Sink"], None]  # (plan, source, reader, out dir, sink)
    layout: Callable[[Any], str]  # req -> the output's layout, as the first line prints it
    tp: bool = False  # whether --tp applies (the layout it is cut or padded for)
    pp: bool = False  # whether --pp and --dp apply (one file per rank)
    no_critic: Optional[str] = None  # why it cannot hold a critic, where it cannot


def read_config(path: Path, where: str, any_architecture: bool = False) -> DecoderConfig:
    """The model's architecture from `path` (config.json or its directory); an unknown one is a ConfigError
    (any_architecture: described instead, `DecoderConfig.foreign`, for a checkpoint trained on transformers)."""
    try:
        return DecoderConfig.from_pretrained(path, any_architecture)
    except ModelConfigError as exc:
        raise ConfigError(where, str(exc)) from None


# --- sources -----------------------------------------------------------------

@dataclass
class Source:
    """A checkpoint to read. `open()` gives an HF-name `SliceReader` (a context manager)."""

    format: Format
    path: Path  # hf / dist: the directory; hybridflow: the role directory (step_N/actor)
    cfg: DecoderConfig
    role: str = "actor"
    layout: Optional[ParallelDims] = None  # hybridflow: the layout its shards were written at
    step_dir: Optional[Path] = None  # hybridflow: the step directory (trainer.json)

    @property
    def kind(self) -> str:
        return self.format.name

    @property
    def value_head(self) -> bool:
        return self.role == "critic"

    def describe(self) -> str:
        at = f" at {self.layout}" if self.layout is not None else ""
        return f"{self.kind} {self.role if self.kind != 'hf' else 'model'}{at}: {self.path}"

    def open(self):
        return self.format.reader(self)


def stage_of(megatron_name: str, layers: int, stages: int, virtual_pp: int = 1) -> int:
    """The pipeline stage holding a parameter (`parallel.stages`, the engine's and the plans' answer)."""
    return param_stage(megatron_name, layers, stages, virtual_pp)


def local_name(megatron_name: str, layers: int, stages: int, virtual_pp: int = 1) -> str:
    """The name on its stage: megatron-core numbers each chunk's layers from 0; at virtual_pp > 1 the
    chunk prefixes it (`parallel.stages.local_name`)."""
    return stages_local_name(megatron_name, layers, stages, virtual_pp)


def hf_names(cfg: DecoderConfig, value_head: bool) -> list[str]:
    """Every HF tensor of the model, in the bridge's order; a critic has the value head instead of lm_head."""
    names = [n for e in model_entries(cfg, value_head) for n in e.hf]
    return names + [VALUE_HEAD] if value_head else names


def model_entries(cfg: DecoderConfig, value_head: bool) -> list[ParamEntry]:
    """The bridge's entries, less the vocabulary output layer for a critic (its value head is apart)."""
    return [e for e in get_bridge(cfg).entries() if not (value_head and e.megatron == OUTPUT_LAYER)]


def hf_dtype(reader, name: str) -> torch.dtype:
    """The dtype a source stores `name` in (read from its index, not its data)."""
    dtype = reader.stored_dtype(name)
    if dtype not in DTYPES.values():
        raise ConfigError("SRC", f"{name} is stored as {dtype}; the tool converts float32, bfloat16 and float16")
    return dtype


class MegatronReader:
    """An HF-name `SliceReader` over a checkpoint that holds whole Megatron tensors (`fetch(megatron_name)`,
    vocabulary maybe padded). Keeps the last assembled tensor's HF pieces, so fused tensors are read once."""

    def __init__(self, cfg: DecoderConfig, value_head: bool, fetch: Callable[[str], torch.Tensor]):
        self.cfg, self.value_head, self._fetch = cfg, value_head, fetch
        self.bridge = get_bridge(cfg)
        self._entry_of = {n: e for e in model_entries(cfg, value_head) for n in e.hf}
        self._shapes = self.bridge.hf_shapes()
        if value_head:
            self._shapes[VALUE_HEAD] = (1, cfg.hidden_size)
        self._cached: dict[str, torch.Tensor] = {}
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return hf_names(self.cfg, self.value_head)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise KeyError(f"no tensor {name!r} in this checkpoint")
        return tuple(self._shapes[name])

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype `name` is stored in, without reading it."""
        entry = self._entry_of.get(name)
        return self._dtype_of(OUTPUT_LAYER if entry is None else entry.megatron)

    def _dtype_of(self, megatron_name: str) -> torch.dtype:
        raise NotImplementedError

    def _whole(self, name: str) -> torch.Tensor:
        if name == VALUE_HEAD and self.value_head:
            return self._fetch(OUTPUT_LAYER)
        if name not in self._cached:
            entry = self._entry_of.get(name)
            if entry is None:
                raise KeyError(f"no tensor {name!r} in this checkpoint")
            t = self._fetch(entry.megatron)
            self.bytes_read += t.numel() * t.element_size()
            self._cached = self.bridge.megatron_to_hf({entry.megatron: t}, partial=True)
        return self._cached[name]

    def __call__(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        t = self._whole(name)
        t = t[rows or slice(None)] if cols is None else t[rows or slice(None), cols]
        return t.contiguous()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._cached = {}


# --- plans -------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One tensor of the output: `name` inside `file`, made from `source` (TP rank `tp_rank` of it)."""

    file: str
    name: str
    shape: tuple[int, ...]
    source: str
    tp_rank: int = 0


@dataclass
class Plan:
    """The whole output, before anything is written."""

    target: str  # "hf" | "hybridflow" | "dist"
    cfg: DecoderConfig
    dtype: torch.dtype
    role: str
    tp: int = 1
    pp: int = 1
    dp: int = 1  # above 1 only for hybridflow, whose DP copies of a rank's file are links
    divisible_by: int = 128
    items: list[Item] = field(default_factory=list)
    virtual_pp: int = 1  # hybridflow: model chunks per pipeline stage (their tensors named per chunk)
    cp: int = 1  # hybridflow: context-parallel ranks, each reading its own file (links, or other experts)
    ep: int = 1  # hybridflow: the experts split over ep ranks of the dp x cp ranks (one file each per TP rank)

    def nbytes(self, item: Item) -> int:
        return math.prod(item.shape) * self.dtype.itemsize

    @property
    def tensor_bytes(self) -> int:
        """What is read and written once (DP copies of hybridflow shards are links)."""
        return sum(self.nbytes(i) for i in self.items)

    @property
    def copies(self) -> int:
        """How many ranks read each written file (hybridflow: the others are hard links)."""
        return self.dp * self.cp // self.ep

    @property
    def total_bytes(self) -> int:
        return self.tensor_bytes * self.copies

    def files(self) -> dict[str, list[Item]]:
        out: dict[str, list[Item]] = {}
        for item in self.items:
            out.setdefault(item.file, []).append(item)
        return out

    def lines(self) -> list[str]:
        """The dry run's printout: per file its tensors (name, shape, source, bytes), then totals."""
        dt = str(self.dtype).removeprefix("torch.")
        out = []
        for file, items in self.files().items():
            out.append(f"{file}  ({len(items)} tensors, {human(sum(self.nbytes(i) for i in items))})")
            for i in items:
                rank = f" [tp rank {i.tp_rank}]" if self.target == "hybridflow" and self.tp > 1 else ""
                out.append(f"  {i.name} {list(i.shape)} {dt} <- {i.source}{rank}")
        if self.copies > 1:
            out.append(f"(each file also read by {self.copies - 1} other data- or context-parallel rank(s) of "
                       f"dp {self.dp} x cp {self.cp}{f' / ep {self.ep}' if self.ep > 1 else ''}: hard links)")
        out.append(f"total: {len(self.items)} tensors in {len(self.files())} file(s), {human(self.total_bytes)}")
        return out


def hf_config(plan: Plan) -> dict:
    """The output's config.json: the model's, with the dtype it is written in."""
    config = plan.cfg.to_hf_dict()
    config["torch_dtype"] = str(plan.dtype).removeprefix("torch.")
    return config


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# --- writing -----------------------------------------------------------------

class Sink:
    """Counts what is written and reports it (`progress(done_bytes)`)."""

    def __init__(self, progress: Callable[[int, str], None] = lambda done, name: None):
        self.done = 0
        self.tensors = 0
        self._progress = progress

    def wrote(self, t: torch.Tensor, name: str) -> None:
        self.done += t.numel() * t.element_size()
        self.tensors += 1
        self._progress(self.done, name)


def checked(item: Item, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as the plan says `item` is: its shape (else a ValueError), in the plan's dtype, contiguous."""
    if tuple(t.shape) != item.shape:
        raise ValueError(f"{item.source} came out as {list(t.shape)}, the plan says {list(item.shape)}")
    return t.to(dtype).contiguous()


def tensor_for(plan: Plan, item: Item, reader) -> torch.Tensor:
    """An item's tensor from the source reader (`bridge.SliceReader`): read and cut, by the bridge."""
    if item.source == VALUE_HEAD:
        if VALUE_HEAD in reader.keys():
            return reader(VALUE_HEAD)
        return torch.zeros(1, plan.cfg.hidden_size, dtype=plan.dtype)  # the engine's fresh value head
    if plan.target == "hf":
        return reader(item.source)
    bridge = get_bridge(plan.cfg, plan.divisible_by, plan.tp)
    entry = next(e for e in bridge.entries() if e.megatron == item.source)
    return bridge.read_shard(entry, reader, item.tp_rank, plan.tp)
