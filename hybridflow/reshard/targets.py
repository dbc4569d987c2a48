"""What a reshard writes, planned as data first (rule 3), then written tensor by tensor.

`plan_hf` / `plan_hybridflow` return a `Plan`: every file of the output, the
tensors in it, their shapes and bytes, and where each comes from (an HF name
of the source, or a Megatron name cut to a TP rank by the bridge). The dry
run prints it; `write_*` execute it through a `Sink` that counts bytes and
draws the progress bar.

- HF: safetensors written by hand, header first (the plan knows every shape
  and offset), then each tensor's bytes as it is read: one tensor in memory.
  Split into `model-0000i-of-0000n.safetensors` with an index past
  `max_shard_bytes`, as `transformers` writes them.
- hybridflow: one `engine_tp{r}_pp{s}_dp{d}.pt` per rank, holding `{"model":
  {local name: shard}}` as `MegatronEngine.save` does (no optimizer state: a
  run started from it begins with fresh Adam moments). One rank's file is
  held at a time (`torch.save` writes a whole dict); DP copies are hard links.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import INDEX_FILE, SINGLE_FILE
from hybridflow.models.config import DecoderConfig
from hybridflow.models.sharding import spec_for
from hybridflow.reshard.sources import VALUE_HEAD, hf_names, local_name, model_entries, shard_file, stage_of

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


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
    dp: int = 1
    divisible_by: int = 128
    items: list[Item] = field(default_factory=list)

    def nbytes(self, item: Item) -> int:
        return math.prod(item.shape) * self.dtype.itemsize

    @property
    def tensor_bytes(self) -> int:
        """What is read and written once (DP copies of hybridflow shards are links)."""
        return sum(self.nbytes(i) for i in self.items)

    @property
    def total_bytes(self) -> int:
        return self.tensor_bytes * (self.dp if self.target == "hybridflow" else 1)

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
        if self.target == "hybridflow" and self.dp > 1:
            out.append(f"(each engine_*_dp0.pt also as dp1..dp{self.dp - 1}: hard links)")
        out.append(f"total: {len(self.items)} tensors in {len(self.files())} file(s), {human(self.total_bytes)}")
        return out


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# --- plans -------------------------------------------------------------------

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


def plan_hybridflow(cfg: DecoderConfig, dtype: torch.dtype, role: str, tp: int, pp: int, dp: int,
                    divisible_by: int) -> Plan:
    """A hybridflow role directory at TP x PP: per rank, the Megatron tensors of its stage, cut to its TP rank
    by the sharding table; the last stage's copy of a tied embedding; a critic's replicated value head."""
    plan = Plan("hybridflow", cfg, dtype, role, tp, pp, dp, divisible_by)
    full = get_bridge(cfg, divisible_by, tp).megatron_shapes()
    critic = role == "critic"
    names = [e.megatron for e in model_entries(cfg, critic)]
    for s in range(pp):
        on_stage = [n for n in names if stage_of(n, cfg.num_layers, pp) == s]
        for r in range(tp):
            file = f"{role}/{shard_file(r, s)}"
            plan.items += [Item(file, local_name(n, cfg.num_layers, pp), shard_shape(full[n], n, tp), n, r)
                           for n in on_stage]
            if s == pp - 1 and critic:
                plan.items.append(Item(file, OUTPUT, (1, cfg.hidden_size), VALUE_HEAD, r))
            elif s == pp - 1 and pp > 1 and cfg.tie_word_embeddings:
                plan.items.append(Item(file, OUTPUT, shard_shape(full[EMBEDDING], EMBEDDING, tp), EMBEDDING, r))
    return plan


def shard_shape(shape: tuple[int, ...], megatron_name: str, tp: int) -> tuple[int, ...]:
    """One TP rank's shape of a Megatron tensor, by the sharding table."""
    dim = spec_for(megatron_name).dim
    if dim is None or tp == 1:
        return tuple(shape)
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


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


def _checked(item: Item, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
            f.write(memoryview(_checked(item, t, dtype).view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())


def write_hf(plan: Plan, reader, out: Path, sink: Sink, extra_config: Optional[dict] = None) -> None:
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
    config = plan.cfg.to_hf_dict()
    config["torch_dtype"] = str(plan.dtype).removeprefix("torch.")
    if plan.role == "critic":  # a one-label token classifier: what `transformers` loads a value model as
        config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "ForTokenClassification")]
        config["num_labels"] = 1
        config["token_classification_bias"] = False  # the value head has none (transformers' default adds one)
    config.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def write_hybridflow(plan: Plan, reader, step_dir: Path, sink: Sink) -> None:
    """Execute a hybridflow plan into a step directory: one shard file per rank, one rank in memory at a time."""
    for file, items in plan.files().items():
        model = {}
        for item in items:
            model[item.name] = _checked(item, tensor_for(plan, item, reader), plan.dtype).clone()
            sink.wrote(model[item.name], item.name)
        path = step_dir / file
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model}, path)
        del model
        for d in range(1, plan.dp):  # every DP replica reads its own file; the weights are the same
            os.link(path, path.with_name(path.name.replace("_dp0.pt", f"_dp{d}.pt")))
    (step_dir / plan.role / "config.json").write_text(json.dumps(plan.cfg.to_hf_dict(), indent=2))
