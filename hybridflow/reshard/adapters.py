"""A LoRA actor's checkpoint at another layout: its shards hold the adapters alone (`engine/lora.py`), each
`linear.lora_A` / `.lora_B` split over TP as the engine splits it (B like a column-parallel weight's rows, A like
a row-parallel weight's columns, the other replicated), named per stage and chunk as the base weights are, an
expert's under its expert-parallel rank's local number.

`convert` reads every adapter whole (TP pieces joined, stages' and expert ranks' names made global) and writes
the checkpoint root a run at `--tp/--pp/--dp/--cp/--ep/--virtual-pp` resumes from: its shards cut as that run's
engine cuts them, trainer.json kept (the base model's record, checked on resume) with the new layout. The Adam
moments stay behind, as in every conversion to hybridflow. The merged model and the PEFT directory are what
the run's export writes (`hf_actor/`, `hf_actor/peft/`); a conversion to another format is refused by option.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch

from hybridflow.checkpoint.format import TRAINER_STATE, model_table, shard_file, trainer_state
from hybridflow.checkpoint.manager import CheckpointManager
from hybridflow.common import atomic_write_json, write_dir_atomically
from hybridflow.engine.experts import ExpertShard, expert_of, first_holder
from hybridflow.engine.lora import COLUMN_TARGETS, Adapted
from hybridflow.errors import ConfigError
from hybridflow.models.sharding import shard_tensor, unshard_tensor
from hybridflow.parallel.layout import ParallelDims
from hybridflow.parallel.stages import chunks_in, layout_label, local_name, param_stage
from hybridflow.reshard.hybridflow import copies, experts_per_shard

SIDES = ("lora_A", "lora_B")


def holds_adapters(source) -> bool:
    """Whether a hybridflow role directory's shards are a LoRA actor's (adapters only)."""
    first = torch.load(source.path / shard_file(0, 0), mmap=True, weights_only=True, map_location="cpu")["model"]
    return bool(first) and all(name.endswith(SIDES) for name in first)


def spec(name: str):
    """How an adapter (`...linear_qkv.lora_B`) splits over TP: as `Adapted` says for its layer."""
    module, side = name.rsplit(".", 1)
    adapted = Adapted(module, "", None, module.rsplit(".", 1)[-1] in COLUMN_TARGETS)
    return adapted.a_spec if side == "lora_A" else adapted.b_spec


def read(source) -> dict[str, torch.Tensor]:
    """Every adapter of a LoRA checkpoint, whole, under its global name (layers and experts numbered as in the
    model)."""
    cfg, layout = source.cfg, source.layout
    load = lambda r, s, rank: torch.load(source.path / shard_file(r, s, *rank), weights_only=True,  # noqa: E731
                                         map_location="cpu")["model"]
    first = load(0, 0, (0, 0))
    vpp = chunks_in(first)
    per_rank = experts_per_shard(first)
    ep = cfg.num_experts // per_rank if per_rank else 1
    wanted = _global_names(cfg, layout.pp, vpp, first, ep)
    out: dict[str, torch.Tensor] = {}
    for s in range(layout.pp):
        for e in range(ep):
            shard = ExpertShard(cfg.num_experts, ep, e)
            pieces = [load(r, s, first_holder(e, layout.cp)) for r in range(layout.tp)]
            for name in wanted:
                mine = shard.local(name)
                if mine is None or param_stage(name, cfg.num_layers, layout.pp, vpp) != s:
                    continue
                if e > 0 and expert_of(name) is None:
                    continue  # a dense adapter: every expert-parallel rank holds it, read from the first
                key = local_name(mine, cfg.num_layers, layout.pp, vpp)
                if key not in pieces[0]:
                    raise ConfigError("SRC", f"{source.path / shard_file(0, s, *first_holder(e, layout.cp))} has "
                                             f"no {key!r}: not a LoRA checkpoint of this model")
                out[name] = unshard_tensor([p[key] for p in pieces], spec(name)).clone()
    return out


def _global_names(cfg, pp: int, vpp: int, first: dict, ep: int) -> list[str]:
    """The global adapter names of the model's layers whose targets the first shard names (every layer
    carries the same targets)."""
    targets = {name.rsplit(".", 2)[-2] for name in first}
    expert = [f"mlp.experts.local_experts.{j}.{t}" for j in range(cfg.num_experts) for t in ("linear_fc1", "linear_fc2")
              if t in targets and any(".local_experts." in n for n in first)]
    dense = [f"self_attention.{t}" for t in ("linear_qkv", "linear_proj") if t in targets]
    dense += [f"mlp.{t}" for t in ("linear_fc1", "linear_fc2")
              if t in targets and any(f"mlp.{t}." in n for n in first)]
    return [f"decoder.layers.{i}.{m}.{side}" for i in range(cfg.num_layers) for m in dense + expert for side in SIDES]


def write(adapters: dict[str, torch.Tensor], cfg, role: str, layout: ParallelDims, vpp: int, ep: int,
          step_dir: Path) -> int:
    """The shards a run at `layout` (x `ep`) saves, adapters only, into `step_dir/role`; the bytes written."""
    written = 0
    folder = step_dir / role
    folder.mkdir(parents=True)
    for s, r, e in ((s, r, e) for s in range(layout.pp) for r in range(layout.tp) for e in range(ep)):
        shard = ExpertShard(cfg.num_experts, ep, e)
        model = {}
        for name, whole in adapters.items():
            mine = shard.local(name)
            if mine is None or param_stage(name, cfg.num_layers, layout.pp, vpp) != s:
                continue
            model[local_name(mine, cfg.num_layers, layout.pp, vpp)] = shard_tensor(whole, spec(name), r,
                                                                                 layout.tp).clone()
        written += sum(t.numel() * t.element_size() for t in model.values())
        torch.save({"model": model}, folder / shard_file(r, s, *first_holder(e, layout.cp)))
    for file, written in copies(layout, ep):  # ranks holding the same tensors as a written file
        os.link(folder / written, folder / file)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    return written


def convert(source, req, out: Callable[[str], None]) -> int:
    """`hybridflow reshard` of a LoRA checkpoint (module doc) to `req.dst`; the bytes written."""
    if req.verify or req.verify_logits:
        raise ConfigError("--verify", "a LoRA checkpoint's adapters are cut and joined exactly, with no model to "
                                      "compare logits of; convert without --verify")
    if req.to != "hybridflow":
        raise ConfigError("--to", f"{source.path} is a LoRA checkpoint (adapters only): convert it to another "
                                  "layout with --to hybridflow; the merged model and the PEFT directory are the run's "
                                  "export (hf_actor/, hf_actor/peft/)")
    layout = ParallelDims(tp=req.tp, pp=req.pp, dp=req.dp, cp=req.cp)
    out(f"reshard: LoRA adapters of {source.describe()} -> hybridflow {layout_label(layout, req.virtual_pp, req.ep)}"
        f": {req.dst}")
    adapters = read(source)
    if req.dry_run:
        for name, t in adapters.items():
            out(f"  {name} {list(t.shape)}")
        out(f"dry run: {len(adapters)} adapters, nothing written")
        return 0
    kept = json.loads((source.step_dir / TRAINER_STATE).read_text()) if source.step_dir else {}
    models = kept.get("models") or {source.role: model_table(source.cfg, req.divisible_by, False)}
    state = {**kept, **trainer_state(kept.get("step", 0), models,  # the base model's record kept (`base`)
                                     {source.role: layout_label(layout, req.virtual_pp, req.ep)})}
    written = []

    def write_root(tmp: Path) -> None:
        def step(step_dir: Path) -> None:
            written.append(write(adapters, source.cfg, source.role, layout, req.virtual_pp, req.ep, step_dir))
            atomic_write_json(step_dir / TRAINER_STATE, state)

        CheckpointManager(tmp, keep_last=0).save(int(state["step"]), step)

    write_dir_atomically(req.dst, write_root, "reshard")
    return written[0]
