"""The hybridflow format: a training run's checkpoint (`hybridflow.checkpoint`), one role at a time.

Read from a checkpoint root (its `latest` step), a `step_N` directory or its `actor/` / `critic/` directory
(a role the FSDP engine saved, torch DCP, is handed to `fsdp.py`): one `engine_tp*_pp*_dp*.pt` per rank,
memory-mapped, a Megatron tensor put together from its TP pieces (`unshard_tensor`) only when asked for
(`ShardsReader`). Written as a checkpoint root a run resumes from (trainer.resume=auto with DST as its
checkpoint root): one step directory through `CheckpointManager` (manifest, `latest`), one shard per rank
holding `{"model": {local name: shard}}` as `MegatronEngine.save` writes it (no optimizer state: a run
started from it begins with fresh Adam moments), cut by `bridge.read_shard` from the source reader, and
trainer.json with the role's tensor table and layout. One rank's file is held at a time (`torch.save` writes
a whole dict); DP copies are hard links.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from hybridflow.checkpoint.format import (FSDP_STATE, LATEST, OUTPUT_LAYER, ROLES, STEP_DIR, TRAINER_STATE,
                                          VALUE_HEAD, model_table, shard_coordinates, shard_file, trainer_state)
from hybridflow.checkpoint.manager import CheckpointManager
from hybridflow.common import atomic_write_json
from hybridflow.errors import ConfigError
from hybridflow.models.bridge import get_bridge
from hybridflow.models.config import DecoderConfig
from hybridflow.models.sharding import spec_for, unshard_tensor
from hybridflow.engine.experts import ExpertShard, expert_of, expert_rank, first_holder
from hybridflow.parallel.layout import ParallelDims
from hybridflow.parallel.stages import chunks_in, layout_label
from hybridflow.reshard import fsdp
from hybridflow.reshard.base import (EMBEDDING, Format, Item, MegatronReader, Plan, Sink, Source, checked,
                                     local_name, model_entries, read_config, stage_of, tensor_for)


# --- reading -----------------------------------------------------------------

def _has_shards(path: Path) -> bool:
    return any(shard_coordinates(p.name) for p in path.iterdir())


def holds(path: Path) -> bool:
    """A role directory (shards), a step directory (trainer.json, a role) or a root (`latest`, steps)."""
    return (_has_shards(path) or (path / TRAINER_STATE).is_file() or (path / LATEST).is_file()
            or any((path / role).is_dir() for role in ROLES)
            or any(STEP_DIR.match(p.name) and p.is_dir() for p in path.iterdir()))


def _latest_step(root: Path) -> Optional[Path]:
    """A checkpoint root's current step: the `latest` marker's, else the highest step directory."""
    marker = root / LATEST
    if marker.is_file():
        name = marker.read_text().strip()
        if STEP_DIR.match(name) and (root / name).is_dir():
            return root / name
    steps = sorted((int(m[1]), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())
    return steps[-1][1] if steps else None


def _role_dir(path: Path, role: str) -> tuple[Path, Optional[Path]]:
    """(role directory, step directory) for a root, a step or a role directory."""
    if _has_shards(path):
        step = path.parent if (path.parent / TRAINER_STATE).is_file() else None
        return path, step
    step = path if (path / TRAINER_STATE).is_file() or (path / role).is_dir() else _latest_step(path)
    if step is None or not (step / role).is_dir():
        raise FileNotFoundError(f"{path} holds no hybridflow {role} checkpoint (no {role}/engine_tp*_pp*_dp*.pt, "
                                f"nor an FSDP {role}/{FSDP_STATE}, under it, its step directories or its 'latest' "
                                "step)")
    return step / role, step


def shard_layout(role_dir: Path) -> ParallelDims:
    """The TP x PP (x CP) layout a role directory's shards were written at (its DP copies are alike; at
    parallel.ep > 1 the first ep of the dp x cp ranks hold the experts between them)."""
    found = {c for p in role_dir.iterdir() if (c := shard_coordinates(p.name))}
    tp, pp, cp = (max(f[i] for f in found) + 1 for i in (0, 1, 3))
    missing = [shard_file(r, s) for s in range(pp) for r in range(tp) if (r, s, 0, 0) not in found]
    if missing:
        raise ConfigError("SRC", f"{role_dir} lacks shard(s) {missing} of its tp={tp} x pp={pp} layout")
    return ParallelDims(tp=tp, pp=pp, cp=cp)


def open_source(path: Path, role: str, config: Optional[Path]) -> Source:
    """A role of a training checkpoint; its model's config.json beside the shards or the step, or `config`."""
    role_dir, step = _role_dir(path, role)
    if fsdp.holds(role_dir):  # this role was trained under the FSDP engine (the other may not have been)
        return fsdp.open_source(role_dir, role, config)
    where = Path(config) if config else next((d for d in (role_dir, step) if d and (d / "config.json").is_file()),
                                             None)
    if where is None:
        raise ConfigError("--config", f"{path} is a hybridflow checkpoint without a config.json: pass the "
                                      "model's (--config MODEL_DIR, the model.path it was trained from)")
    return Source(FORMAT, role_dir, read_config(where, "--config"), role=role, layout=shard_layout(role_dir),
                  step_dir=step)


class ShardsReader(MegatronReader):
    """A hybridflow role directory: one `torch.save`d shard per rank, memory-mapped (`weights_only`)."""

    def __init__(self, source: Source):
        self.source = source
        for s in range(source.layout.pp):
            for r in range(source.layout.tp):
                self._model(r, s)  # every file readable, before anything is written
        # Model chunks per stage (the interleaved schedule's virtual_pp): the shards name them.
        self.virtual_pp = chunks_in(self._model(0, 0).keys())
        # Expert parallelism (parallel.ep): expert-parallel rank e holds experts e * n onwards, numbered from 0
        # (`engine/experts.py`); n = the experts a shard names, fewer than the model's at ep > 1.
        self.experts_per_shard = experts_per_shard(self._model(0, 0))
        super().__init__(source.cfg, source.value_head, self._gather)

    def _place(self, megatron_name: str) -> tuple[int, str, tuple[int, int]]:
        """(stage, name in its shard, (DP, CP) rank of the shard) of a Megatron tensor: `parallel.stages`, as
        the engine wrote it; an expert's from the first rank holding its expert-parallel rank ((0, 0)
        otherwise)."""
        cfg, pp, rank = self.cfg, self.source.layout.pp, (0, 0)
        j, n = expert_of(megatron_name), self.experts_per_shard
        if j is not None and n and n < cfg.num_experts:
            rank = first_holder(j // n, self.source.layout.cp)
            megatron_name = ExpertShard(cfg.num_experts, cfg.num_experts // n, j // n).local(megatron_name)
        return (stage_of(megatron_name, cfg.num_layers, pp, self.virtual_pp),
                local_name(megatron_name, cfg.num_layers, pp, self.virtual_pp), rank)

    def _model(self, tp_rank: int, stage: int, rank: tuple[int, int] = (0, 0)) -> dict[str, torch.Tensor]:
        """A rank's tensors, memory-mapped (read from disk as they are used; unmapped once dropped)."""
        path = self.source.path / shard_file(tp_rank, stage, *rank)
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise ConfigError("SRC", f"{path} is not a hybridflow engine shard (no 'model' table)")
        return state["model"]

    def _dtype_of(self, megatron_name: str) -> torch.dtype:
        stage, name, rank = self._place(megatron_name)
        return self._model(0, stage, rank)[name].dtype

    def _gather(self, megatron_name: str) -> torch.Tensor:
        cfg, layout = self.cfg, self.source.layout
        stage, name, rank = self._place(megatron_name)
        pieces = []
        for r in range(layout.tp):
            model = self._model(r, stage, rank)
            if name not in model:
                raise ConfigError("SRC", f"{self.source.path / shard_file(r, stage, *rank)} has no {name!r}: not a "
                                         f"{cfg.model_type} model of this config, or not its {self.source.role}?")
            pieces.append(model[name].clone())
            del model
            if self.value_head and megatron_name == OUTPUT_LAYER:
                return pieces[0]  # the value head is replicated
        return unshard_tensor(pieces, spec_for(megatron_name))


# --- writing -----------------------------------------------------------------

def plan_hybridflow(cfg: DecoderConfig, dtype: torch.dtype, role: str, tp: int, pp: int, dp: int,
                    divisible_by: int, virtual_pp: int = 1, cp: int = 1, ep: int = 1) -> Plan:
    """A hybridflow role directory at TP x PP: per rank, the Megatron tensors of its stage, cut to its TP rank
    by the sharding table; the last stage's copy of a tied embedding; a critic's replicated value head.
    virtual_pp > 1: each stage's tensors named per model chunk, as a run at that actor.parallel.virtual_pp
    loads them (`parallel.stages.local_name`). ep > 1: one file per TP rank and expert-parallel rank (the
    first of the dp x cp ranks that hold it), with that rank's experts under its local numbers."""
    plan = Plan("hybridflow", cfg, dtype, role, tp, pp, dp, divisible_by, virtual_pp=virtual_pp, cp=cp, ep=ep)
    last = lambda name: local_name(name, cfg.num_layers, pp, virtual_pp)  # noqa: E731 (the last chunk's name)
    full = get_bridge(cfg, divisible_by, tp).megatron_shapes()
    critic = role == "critic"
    names = [e.megatron for e in model_entries(cfg, critic)]
    for s, r, e in ((s, r, e) for s in range(pp) for r in range(tp) for e in range(ep)):
        shard = ExpertShard(cfg.num_experts, ep, e)
        on_stage = [(n, shard.local(n)) for n in names if stage_of(n, cfg.num_layers, pp, virtual_pp) == s]
        file = f"{role}/{shard_file(r, s, *first_holder(e, cp))}"
        plan.items += [Item(file, local_name(mine, cfg.num_layers, pp, virtual_pp), shard_shape(full[n], n, tp), n, r)
                       for n, mine in on_stage if mine is not None]  # not another expert-parallel rank's expert
        if s == pp - 1 and critic:
            plan.items.append(Item(file, last(OUTPUT_LAYER), (1, cfg.hidden_size), VALUE_HEAD, r))
        elif s == pp - 1 and pp > 1 and cfg.tie_word_embeddings:
            plan.items.append(Item(file, last(OUTPUT_LAYER), shard_shape(full[EMBEDDING], EMBEDDING, tp),
                                   EMBEDDING, r))
    return plan


def copies(layout: ParallelDims, ep: int) -> list[tuple[str, str]]:
    """(shard file, the written shard file it links to) for every rank of `layout` that reads a copy: each
    (DP, CP) rank reads the file of the first rank holding its expert-parallel rank (at ep = 1: DP 0, CP 0)."""
    out = []
    for s, r, d, c in ((s, r, d, c) for s in range(layout.pp) for r in range(layout.tp) for d in range(layout.dp)
                       for c in range(layout.cp)):
        first = first_holder(expert_rank(d, c, layout.cp, ep), layout.cp)
        if (d, c) != first:
            out.append((shard_file(r, s, d, c), shard_file(r, s, *first)))
    return out


def experts_per_shard(names) -> int:
    """How many of each layer's experts a shard with these tensor names holds (their local numbers count from
    0); 0 for a dense model's."""
    local = {expert_of(k) for k in names} - {None}
    return max(local) + 1 if local else 0


def shard_shape(shape: tuple[int, ...], megatron_name: str, tp: int) -> tuple[int, ...]:
    """One TP rank's shape of a Megatron tensor, by the sharding table."""
    dim = spec_for(megatron_name).dim
    if dim is None or tp == 1:
        return tuple(shape)
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def write_shards(plan: Plan, reader, step_dir: Path, sink: Sink) -> None:
    """Execute a hybridflow plan into a step directory: one shard file per rank, one rank in memory at a time."""
    for file, items in plan.files().items():
        model = {}
        for item in items:
            model[item.name] = checked(item, tensor_for(plan, item, reader), plan.dtype).clone()
            sink.wrote(model[item.name], item.name)
        path = step_dir / file
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model}, path)
        del model
    layout = ParallelDims(tp=plan.tp, pp=plan.pp, dp=plan.dp, cp=plan.cp)
    for file, written in copies(layout, plan.ep):  # every rank reads its own file; these hold the same tensors
        os.link(step_dir / plan.role / written, step_dir / plan.role / file)
    (step_dir / plan.role / "config.json").write_text(json.dumps(plan.cfg.to_hf_dict(), indent=2))


def _state(source: Source, plan: Plan) -> dict:
    """trainer.json for the output: the source run's (its step, KL coefficient, sampler) where there is one,
    with this role's layout and model table; from an HF model, step 0 (a run starts at its first step)."""
    kept = {}
    if source.step_dir is not None and (source.step_dir / TRAINER_STATE).is_file():
        kept = json.loads((source.step_dir / TRAINER_STATE).read_text())
    models = {plan.role: model_table(source.cfg, plan.divisible_by, plan.role == "critic")}
    layouts = {plan.role: layout_label(ParallelDims(tp=plan.tp, pp=plan.pp, dp=plan.dp, cp=plan.cp), plan.virtual_pp,
                                       plan.ep)}
    return {**kept, **trainer_state(kept.get("step", 0), models, layouts)}


def write_checkpoint(plan: Plan, source: Source, reader, root: Path, sink: Sink) -> None:
    """A checkpoint root a run resumes from (trainer.resume=auto, trainer.checkpoint_dir=DST): its step
    directory through `CheckpointManager` (manifest, `latest` marker), trainer.json beside the shards."""
    state = _state(source, plan)

    def write(step_dir: Path) -> None:
        write_shards(plan, reader, step_dir, sink)
        atomic_write_json(step_dir / TRAINER_STATE, state)

    CheckpointManager(root, keep_last=0).save(int(state["step"]), write)


FORMAT = Format("hybridflow", "hybridflow", holds, open_source, ShardsReader,
                lambda source, req, dtype: plan_hybridflow(source.cfg, dtype, source.role, req.tp, req.pp, req.dp,
                                                           req.divisible_by, req.virtual_pp, req.cp, req.ep),
                write_checkpoint, lambda req: layout_label(ParallelDims(tp=req.tp, pp=req.pp, dp=req.dp, cp=req.cp),
                                                           req.virtual_pp, req.ep), tp=True, pp=True)
