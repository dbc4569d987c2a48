"""What a reshard reads: a checkpoint on disk, seen as HF tensors read one at a time.

Every source, whatever its format and layout, is opened as a
`bridge.SliceReader` in HF names: the bridge's `read_shard` then cuts any
target TP shard out of it, and the HF writer copies it tensor by tensor. So
the sharding rules live only in `models/sharding.py` and the name mapping
only in `models/bridge.py`; this module only finds tensors.

- `hf`: a directory with `model.safetensors` or `model.safetensors.index.json`,
  read with `safe_open(...).get_slice` (`models.checkpoint.SafetensorsReader`).
- `hybridflow`: a training checkpoint (a root with `latest`, a `step_N`
  directory, or its `actor/` / `critic/` directory), one `engine_tp*_pp*_dp*.pt`
  per rank, read memory-mapped: a Megatron tensor is put together from its TP
  pieces only when asked for.
- `dist`: a megatron-core `dist_checkpointing` directory (`reshard/dist.py`).

A Megatron-layout source keeps the last whole tensor it assembled, so the
three HF tensors of one fused QKV (or the two of `[gate; up]`) cost one
assembly; peak memory stays near the largest tensor.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open

from hybridflow.errors import ConfigError
from hybridflow.models.bridge import ParamEntry, get_bridge
from hybridflow.models.checkpoint import INDEX_FILE, SINGLE_FILE, SafetensorsReader, check_hf_checkpoint
from hybridflow.models.config import DecoderConfig, ModelConfigError
from hybridflow.models.sharding import spec_for, unshard_tensor
from hybridflow.parallel.layout import ParallelDims

ROLES = ("actor", "critic")
VALUE_HEAD = "score.weight"  # the critic's value head in HF form (a one-label token classifier)
_SHARD_FILE = re.compile(r"^engine_tp(\d+)_pp(\d+)_dp(\d+)\.pt$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_STEP = re.compile(r"^step_(\d+)$")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def shard_file(tp_rank: int, pp_rank: int, dp_rank: int = 0) -> str:
    """The engine's file name for one rank's shard (`MegatronEngine.shard_path`)."""
    return f"engine_tp{tp_rank}_pp{pp_rank}_dp{dp_rank}.pt"


def stage_of(megatron_name: str, layers: int, stages: int) -> int:
    """The pipeline stage holding a parameter: whole layers, evenly; embedding first, the rest last."""
    match = _LAYER.match(megatron_name)
    if match:
        return int(match[1]) // (layers // stages)
    return 0 if megatron_name.startswith("embedding.") else stages - 1


def local_name(megatron_name: str, layers: int, stages: int) -> str:
    """The name on its stage: megatron-core numbers each stage's layers from 0."""
    match = _LAYER.match(megatron_name)
    if match is None:
        return megatron_name
    first = stage_of(megatron_name, layers, stages) * (layers // stages)
    return f"decoder.layers.{int(match[1]) - first}.{match[2]}"


def read_config(path: Path, where: str) -> DecoderConfig:
    """The model's architecture from `path` (config.json or its directory); an unknown one is a ConfigError."""
    try:
        return DecoderConfig.from_pretrained(path)
    except ModelConfigError as exc:
        raise ConfigError(where, str(exc)) from None


# --- sources -----------------------------------------------------------------

@dataclass
class Source:
    """A checkpoint to read. `open()` gives an HF-name `SliceReader` (a context manager)."""

    kind: str  # "hf" | "hybridflow" | "dist"
    path: Path  # hf / dist: the directory; hybridflow: the role directory (step_N/actor)
    cfg: DecoderConfig
    role: str = "actor"
    layout: Optional[ParallelDims] = None  # hybridflow: the layout its shards were written at
    step_dir: Optional[Path] = None  # hybridflow: the step directory (trainer.json)

    @property
    def value_head(self) -> bool:
        return self.role == "critic"

    def describe(self) -> str:
        at = f" at {self.layout}" if self.layout is not None else ""
        return f"{self.kind} {self.role if self.kind != 'hf' else 'model'}{at}: {self.path}"

    def open(self):
        if self.kind == "hf":
            return SafetensorsFiles(self.path)
        if self.kind == "hybridflow":
            return ShardsReader(self)
        from hybridflow.reshard.dist import DistReader

        return DistReader(self)


def hf_names(cfg: DecoderConfig, value_head: bool) -> list[str]:
    """Every HF tensor of the model, in the bridge's order; a critic has the value head instead of lm_head."""
    names = [n for e in model_entries(cfg, value_head) for n in e.hf]
    return names + [VALUE_HEAD] if value_head else names


def model_entries(cfg: DecoderConfig, value_head: bool) -> list[ParamEntry]:
    """The bridge's entries, less the vocabulary output layer for a critic (its value head is apart)."""
    return [e for e in get_bridge(cfg).entries() if not (value_head and e.megatron == "output_layer.weight")]


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
        if self._dtypes[name] not in _DTYPES:
            raise ConfigError("SRC", f"{name} is stored as {self._dtypes[name]}; the tool converts F32, BF16, F16")
        return _DTYPES[self._dtypes[name]]

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
        return self._dtype_of("output_layer.weight" if entry is None else entry.megatron)

    def _dtype_of(self, megatron_name: str) -> torch.dtype:
        raise NotImplementedError

    def _whole(self, name: str) -> torch.Tensor:
        if name == VALUE_HEAD and self.value_head:
            return self._fetch("output_layer.weight")
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


class ShardsReader(MegatronReader):
    """A hybridflow role directory: one `torch.save`d shard per rank, memory-mapped (`weights_only`)."""

    def __init__(self, source: Source):
        self.source = source
        for s in range(source.layout.pp):
            for r in range(source.layout.tp):
                self._model(r, s)  # every file readable, before anything is written
        super().__init__(source.cfg, source.value_head, self._gather)

    def _model(self, tp_rank: int, stage: int) -> dict[str, torch.Tensor]:
        """A rank's tensors, memory-mapped (read from disk as they are used; unmapped once dropped)."""
        path = self.source.path / shard_file(tp_rank, stage)
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise ConfigError("SRC", f"{path} is not a hybridflow engine shard (no 'model' table)")
        return state["model"]

    def _dtype_of(self, megatron_name: str) -> torch.dtype:
        stage = stage_of(megatron_name, self.cfg.num_layers, self.source.layout.pp)
        return self._model(0, stage)[local_name(megatron_name, self.cfg.num_layers, self.source.layout.pp)].dtype

    def _gather(self, megatron_name: str) -> torch.Tensor:
        cfg, layout = self.cfg, self.source.layout
        stage = stage_of(megatron_name, cfg.num_layers, layout.pp)
        name = local_name(megatron_name, cfg.num_layers, layout.pp)
        pieces = []
        for r in range(layout.tp):
            model = self._model(r, stage)
            if name not in model:
                raise ConfigError("SRC", f"{self.source.path / shard_file(r, stage)} has no {name!r}: not a "
                                         f"{cfg.model_type} model of this config, or not its {self.source.role}?")
            pieces.append(model[name].clone())
            del model
            if self.value_head and megatron_name == "output_layer.weight":
                return pieces[0]  # the value head is replicated
        return unshard_tensor(pieces, spec_for(megatron_name))


# --- finding what a path holds -----------------------------------------------

def _hf_dir(path: Path) -> bool:
    return (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()


def _dist_dir(path: Path) -> bool:
    meta = path / "metadata.json"
    if not meta.is_file():
        return False
    try:
        return "sharded_backend" in json.loads(meta.read_text())
    except ValueError:
        return False


def _latest_step(root: Path) -> Optional[Path]:
    """A checkpoint root's current step: the `latest` marker's, else the highest step directory."""
    marker = root / "latest"
    if marker.is_file():
        name = marker.read_text().strip()
        if _STEP.match(name) and (root / name).is_dir():
            return root / name
    steps = sorted((int(m[1]), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())
    return steps[-1][1] if steps else None


def _role_dir(path: Path, role: str) -> tuple[Path, Optional[Path]]:
    """(directory of engine shards, step directory) for a root, a step or a role directory."""
    if any(_SHARD_FILE.match(p.name) for p in path.iterdir()):
        step = path.parent if (path.parent / "trainer.json").is_file() else None
        return path, step
    step = path if (path / "trainer.json").is_file() or (path / role).is_dir() else _latest_step(path)
    if step is None or not (step / role).is_dir():
        raise FileNotFoundError(f"{path} holds no hybridflow {role} checkpoint (no {role}/engine_tp*_pp*_dp*.pt "
                                "under it, its step directories or its 'latest' step)")
    return step / role, step


def shard_layout(role_dir: Path) -> ParallelDims:
    """The TP x PP layout a role directory's shards were written at (its DP copies are alike)."""
    found = [tuple(int(g) for g in m.groups()) for p in role_dir.iterdir() if (m := _SHARD_FILE.match(p.name))]
    tp, pp = max(f[0] for f in found) + 1, max(f[1] for f in found) + 1
    missing = [shard_file(r, s) for s in range(pp) for r in range(tp) if (r, s, 0) not in found]
    if missing:
        raise ConfigError("SRC", f"{role_dir} lacks shard(s) {missing} of its tp={tp} x pp={pp} layout")
    return ParallelDims(tp=tp, pp=pp)


def open_source(path: str | Path, role: str = "actor", config: Optional[str | Path] = None) -> Source:
    """The checkpoint at `path`, its format found from its files. `config`: the model's config.json (or its
    directory) where the checkpoint has none beside it (a training run's checkpoints)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"SRC: no checkpoint directory at {path}")
    if role not in ROLES:
        raise ConfigError("--role", f"{role!r} is not one of {ROLES}")
    if _hf_dir(path):
        cfg = read_config(Path(config or path), "SRC config.json")
        if _is_critic_hf(path):
            return Source("hf", path, cfg, role="critic")
        try:  # every tensor there, in its shape (headers only): refused before anything is written
            check_hf_checkpoint(path, cfg)
        except ModelConfigError as exc:
            raise ConfigError("SRC", str(exc)) from None
        return Source("hf", path, cfg, role=role)  # role critic: a critic from this LM, its value head fresh
    if _dist_dir(path):
        return Source("dist", path, read_config(Path(config or path), "SRC config.json"), role=role)
    role_dir, step = _role_dir(path, role)
    where = Path(config) if config else next((d for d in (role_dir, step) if d and (d / "config.json").is_file()),
                                             None)
    if where is None:
        raise ConfigError("--config", f"{path} is a hybridflow checkpoint without a config.json: pass the "
                                      "model's (--config MODEL_DIR, the model.path it was trained from)")
    return Source("hybridflow", role_dir, read_config(where, "--config"), role=role,
                  layout=shard_layout(role_dir), step_dir=step)


def _is_critic_hf(path: Path) -> bool:
    """An HF directory written from a critic: a one-label token classifier (`score.weight`, no lm_head)."""
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(a).endswith("ForTokenClassification") for a in archs)


def hf_dtype(reader, name: str) -> torch.dtype:
    """The dtype a source stores `name` in (read from its index, not its data)."""
    dtype = reader.stored_dtype(name)
    if dtype not in _DTYPES.values():
        raise ConfigError("SRC", f"{name} is stored as {dtype}; the tool converts float32, bfloat16 and float16")
    return dtype
