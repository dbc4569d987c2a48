"""The fsdp format: a torch DCP checkpoint as `FSDPEngine.save` writes it (engine/fsdp.py), one role at a time.

Read from the role directory (`actor/`: `.metadata`, one `__R_0.distcp` per rank, `engine.json`); a trainer's
step directory or checkpoint root holding one is the hybridflow format's to find (`hybridflow.py`), which
hands an FSDP role directory here, so a step may hold one role from each engine. `engine.json` is the
authority: a DCP directory without it is refused (it is not what the engine wrote, or rank 0 did not finish),
and so is a critic (`value_head`) read as an actor or the other way round.

The names are the engine's own: its module (`LanguageModel` / `ValueModel`, built on the `meta` device)
under DCP's key of the model's state dict, `model.decoder.<generation name>` and a critic's
`model.head.weight`; their whole shapes come from that module and must match the checkpoint's metadata.
Each tensor is read alone, whole, by `torch.distributed.checkpoint.load` with `no_dist=True` (no process
group; DCP puts the ranks' dim-0 chunks together), into a tensor allocated from the metadata; Adam's state
beside it is never read. A generation tensor is a Megatron one with the vocabulary unpadded, so
`MegatronReader` turns it into HF tensors, and every other format's writer cuts from that.

A role trained on a `transformers` model (`<role>.fsdp.modeling`, engine.json's `modeling`) holds HF
tensors instead, under `model.model.<HF name>` (a critic's base model: the name less its leading `model.`);
the reader fuses each entry's parts into the Megatron tensor, so the rest is the same. A model
hybridflow's decoder does not build at all (GPT-2, ...: `DecoderConfig.native` False) converts to HF only,
each stored tensor under its own name (`ForeignDCPReader`, `plan_foreign_hf`).

Written (`--to fsdp`) as that directory: one `torch.distributed.checkpoint.save` of the whole tensors
(`no_dist`, so the write holds the model, as `dist` does), `engine.json` (world 1, no optimizer, no
schedule) and the model's config.json, for hybridflow's decoder; `FSDPEngine.load` takes it at any world
size (DCP reshards) and starts a fresh optimizer.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import torch

from hybridflow.checkpoint.format import FSDP_STATE, OUTPUT_LAYER, TRAINER_STATE, VALUE_HEAD
from hybridflow.errors import ConfigError
from hybridflow.models.bridge import get_bridge
from hybridflow.models.config import DecoderConfig
from hybridflow.parallel.layout import ParallelDims
from hybridflow.reshard import dist
from hybridflow.reshard.hf import write_safetensors
from hybridflow.reshard.base import (Format, Item, MegatronReader, Plan, Sink, Source, checked, hf_config,
                                     model_entries, read_config, tensor_for)

MODEL = "model"  # FSDPEngine's key of the model's state dict in what it saves (the optimizer's is beside it)
DCP_METADATA = ".metadata"  # what torch DCP writes beside the ranks' data files
FILE = "(torch DCP)"


# --- reading -----------------------------------------------------------------

def _is_dcp(path: Path) -> bool:
    """A torch DCP directory that is not megatron-core's (which writes its metadata.json beside)."""
    return (path / DCP_METADATA).is_file() and not dist.holds(path)


def holds(path: Path) -> bool:
    """An FSDP engine's directory: its engine.json, or torch DCP data (refused at open without engine.json)."""
    return path.is_dir() and ((path / FSDP_STATE).is_file() or _is_dcp(path))


def read_state(role_dir: Path) -> dict:
    """engine.json of an FSDP role directory; a ConfigError naming it when it is missing or not the engine's."""
    path = role_dir / FSDP_STATE
    if not path.is_file():
        raise ConfigError("SRC", f"{role_dir} is a torch DCP checkpoint without {FSDP_STATE}: not one FSDPEngine "
                                 f"saved (or its rank 0 did not finish), so which model it holds is unknown")
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or state.get("engine") != "fsdp" or not isinstance(state.get("value_head"),
                                                                                            bool):
            raise ValueError('not {"engine": "fsdp", "value_head": true|false, ...}')
    except ValueError as exc:
        raise ConfigError("SRC", f"{path} is not an FSDP engine's state ({exc})") from None
    return state


def open_source(path: Path, role: str, config: Optional[Path]) -> Source:
    """The FSDP role directory `path` (a trainer's step holding it is the hybridflow format's to open, which
    hands it here); the model's config.json beside it or its step's, or `config`."""
    role_dir, step = path, path.parent if (path.parent / TRAINER_STATE).is_file() else None
    state = read_state(role_dir)
    if state["value_head"] != (role == "critic"):
        saved = "a critic (a value head, no vocabulary output)" if state["value_head"] else "an actor (no value head)"
        fix = ("--role critic: its HF form is a one-label ...ForTokenClassification, not a causal LM"
               if state["value_head"] else "--role actor")
        raise ConfigError("--role", f"{role_dir} holds {saved} by its {FSDP_STATE}, not the {role} asked for; "
                                    f"pass {fix}")
    where = Path(config) if config else next((d for d in (role_dir, step) if d and (d / "config.json").is_file()),
                                             None)
    if where is None:
        raise ConfigError("--config", f"{path} is an FSDP checkpoint without a config.json: pass the model's "
                                      "(--config MODEL_DIR, the model.path it was trained from)")
    layout = ParallelDims(dp=int(state.get("world", 1)))
    # a role trained on transformers may be a model hybridflow's decoder does not build (converted to HF only)
    cfg = read_config(where, "--config", any_architecture=state.get("modeling") == "transformers")
    return Source(FORMAT, role_dir, cfg, role=role, layout=layout, step_dir=step)


def engine_tensors(cfg: DecoderConfig, value_head: bool,
                   modeling: str = "hybridflow") -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """{Megatron name: [(DCP key, whole shape), ...]} of the FSDP engine's model. On hybridflow's decoder
    (`modeling`) one tensor each: the bridge's entries by their generation names in the engine's module (on
    `meta`); on a `transformers` model (engine/fsdp_hf.py) the entry's HF tensors, by their HF names under
    the engine's wrapper (`model.<hf name>`; a critic's base model drops the causal LM's `model.` prefix).
    A critic's output layer is its `head`."""
    if modeling == "transformers":
        shapes = get_bridge(cfg).hf_shapes()
        inner = (lambda hf: f"{MODEL}.model.{hf.removeprefix('model.')}") if value_head else (
            lambda hf: f"{MODEL}.model.{hf}")
        out = {e.megatron: [(inner(hf), tuple(shapes[hf])) for hf in e.hf] for e in model_entries(cfg, value_head)}
        if value_head:
            out[OUTPUT_LAYER] = [(f"{MODEL}.head.weight", (1, cfg.hidden_size))]
        return out
    from hybridflow.engine.fsdp import LanguageModel, ValueModel

    with torch.device("meta"):
        module = ValueModel(cfg) if value_head else LanguageModel(cfg)
    params = dict(module.named_parameters())
    out = {}
    for e in model_entries(cfg, value_head):
        name = f"decoder.{e.generation}"
        if name not in params:
            raise KeyError(f"the FSDP engine's model has no {name!r} for this config")
        out[e.megatron] = [(f"{MODEL}.{name}", tuple(params.pop(name).shape))]
    if value_head:
        out[OUTPUT_LAYER] = [(f"{MODEL}.head.weight", tuple(params.pop("head.weight").shape))]
    if params:
        raise KeyError(f"the FSDP engine's model has parameters the bridge does not name: {sorted(params)[:3]}")
    return out


class DCPReader(MegatronReader):
    """HF tensors of an FSDP checkpoint, each engine tensor loaded whole and alone (`dcp.load`, `no_dist`)."""

    def __init__(self, source: Source):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = source.path
        try:
            stored = FileSystemReader(str(source.path)).read_metadata().state_dict_metadata
        except Exception as exc:  # a torn or foreign .metadata: say which file
            raise ConfigError("SRC", f"{source.path / DCP_METADATA} is not readable as torch DCP metadata "
                                     f"({type(exc).__name__}: {exc})") from None
        # whose model code wrote it (engine.json; before the key existed, always hybridflow's decoder)
        self.modeling = read_state(source.path).get("modeling", "hybridflow")
        self.tensors = engine_tensors(source.cfg, source.value_head, self.modeling)
        for parts in self.tensors.values():  # every tensor checked before anything is written
            for key, shape in parts:
                meta = stored.get(key)
                if not isinstance(meta, TensorStorageMetadata):
                    raise ConfigError("SRC", f"{source.path} holds no tensor {key!r}: not a {source.cfg.model_type} "
                                             f"{source.role} of this config (--config)?")
                if tuple(meta.size) != shape:
                    raise ConfigError("SRC", f"{source.path}: {key} is {list(meta.size)}, this config's model has "
                                             f"{list(shape)} (--config is not the model it was trained from?)")
        self.stored = {key: stored[key] for parts in self.tensors.values() for key, _ in parts}
        self.entries = {e.megatron: e for e in model_entries(source.cfg, source.value_head)}
        super().__init__(source.cfg, source.value_head, self._load_one)

    def _dtype_of(self, megatron_name: str) -> torch.dtype:
        return self.stored[self.tensors[megatron_name][0][0]].properties.dtype

    def _load_one(self, megatron_name: str) -> torch.Tensor:
        """The whole Megatron tensor (vocabulary unpadded): the engine's one tensor, or its HF parts fused."""
        parts = [self._load_key(key) for key, _ in self.tensors[megatron_name]]
        if self.modeling == "transformers" and megatron_name in self.entries:
            return self.bridge.fuse_parts(self.entries[megatron_name], parts)
        return parts[0]

    def _load_key(self, key: str) -> torch.Tensor:
        return load_whole(self.path, key, self.stored[key])


def load_whole(path: Path, key: str, meta) -> torch.Tensor:
    """The tensor `key` of the DCP checkpoint at `path` (its metadata `meta`), whole and alone: `dcp.load`
    with `no_dist` (no process group; DCP puts the ranks' dim-0 chunks together)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({key: out}, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return out


class ForeignDCPReader:
    """The HF tensors of an FSDP checkpoint of a model hybridflow's decoder does not build (GPT-2, ...;
    `DecoderConfig.native` False), under the names its transformers class gives them: each stored
    `model.model.<name>` read whole and alone (`load_whole`, as `DCPReader` reads), then sliced."""

    PREFIX = f"{MODEL}.model."

    def __init__(self, source: Source):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = source.path
        stored = FileSystemReader(str(source.path)).read_metadata().state_dict_metadata
        self.stored = {key[len(self.PREFIX):]: meta for key, meta in stored.items()
                       if key.startswith(self.PREFIX) and isinstance(meta, TensorStorageMetadata)}
        if not self.stored:
            raise ConfigError("SRC", f"{source.path} holds no tensor under {self.PREFIX!r}: not an FSDP checkpoint "
                                     f"of a transformers model")
        if source.cfg.tie_word_embeddings:  # the state dict names the tied output layer too: the embedding again
            self.stored.pop("lm_head.weight", None)

    def keys(self) -> list[str]:
        return list(self.stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.stored[name].size)

    def stored_dtype(self, name: str) -> torch.dtype:
        return self.stored[name].properties.dtype

    def __call__(self, name: str, rows=None, cols=None) -> torch.Tensor:
        t = load_whole(self.path, self.PREFIX + name, self.stored[name])
        t = t[rows or slice(None)] if cols is None else t[rows or slice(None), cols]
        return t.contiguous()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def open_reader(source: Source):
    """The reader of an FSDP checkpoint: by Megatron entries (`DCPReader`), or by the transformers model's
    own names where hybridflow's decoder does not build the model (`ForeignDCPReader`)."""
    return DCPReader(source) if source.cfg.native else ForeignDCPReader(source)


def plan_foreign_hf(source: Source, req, dtype: Optional[torch.dtype], reader: ForeignDCPReader) -> Plan:
    """`hybridflow reshard` of a model only transformers builds: its actor to HF, every stored tensor under
    its own name in one safetensors file, beside the config.json the run read. Anything else is refused:
    the other formats (and a critic's HF form) are laid out by hybridflow's bridge, which does not map it."""
    why = source.cfg.why_foreign
    if req.to != "hf":
        raise ConfigError("--to", f"{req.to}: {why}; a checkpoint of it converts to hf only")
    if source.value_head:
        raise ConfigError("--role", f"critic: {why}; its value model has no HF form here (the actor converts)")
    if req.verify or req.verify_logits:
        raise ConfigError("--verify", f"{why}; reading the output back with transformers is the check")
    names = reader.keys()
    plan = Plan("hf", source.cfg, dtype or reader.stored_dtype(names[0]), source.role)
    plan.items = [Item("model.safetensors", name, reader.shape(name), name) for name in names]
    return plan


def write_foreign_hf(plan: Plan, source: Source, reader: ForeignDCPReader, out: Path, sink: Sink) -> None:
    def each():
        for item in plan.items:
            t = reader(item.source).to(plan.dtype)
            yield t
            sink.wrote(t, item.name)
    write_safetensors(out / "model.safetensors", plan.items, plan.dtype, each())
    config = {**source.cfg.hf_config, "torch_dtype": str(plan.dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2))


# --- writing -----------------------------------------------------------------

def plan_fsdp(cfg: DecoderConfig, dtype: torch.dtype, role: str) -> Plan:
    """The engine's tensors whole (the vocabulary unpadded), under its DCP keys."""
    plan = Plan("fsdp", cfg, dtype, role)
    critic = role == "critic"
    plan.items = [Item(FILE, key, shape, VALUE_HEAD if critic and name == OUTPUT_LAYER else name)
                  for name, [(key, shape)] in engine_tensors(cfg, critic).items()]  # one tensor each: the decoder's
    return plan


def write_fsdp(plan: Plan, source: Source, reader, out: Path, sink: Sink) -> None:
    """Execute an fsdp plan into `out`: every tensor read from the source, one DCP save, engine.json."""
    import torch.distributed.checkpoint as dcp

    bridge = get_bridge(plan.cfg)
    entries = {e.megatron: e for e in bridge.entries()}
    state = {}
    for item in plan.items:
        if item.source == VALUE_HEAD:
            t = tensor_for(plan, item, reader)
        else:  # the generation tensor: fused from its HF parts, unpadded
            e = entries[item.source]
            t = bridge.fuse_parts(e, [reader(n) for n in e.hf])
        state[item.name] = checked(item, t, plan.dtype).clone()
        sink.wrote(state[item.name], item.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(out), no_dist=True)
    meta = {"engine": "fsdp", "world": 1, "value_head": plan.role == "critic", "optimizer": False,
            "scheduler": None}
    (out / FSDP_STATE).write_text(json.dumps(meta, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config(plan), indent=2))


FORMAT = Format("fsdp", "FSDP", holds, open_source, open_reader,
                lambda source, req, dtype: plan_fsdp(source.cfg, dtype, source.role), write_fsdp,
                lambda req: "(whole tensors; FSDPEngine.load reshards them to its world)")
