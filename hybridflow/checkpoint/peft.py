"""A LoRA actor's adapters as a PEFT directory: `adapter_config.json` + `adapter_model.safetensors`.

`peft.PeftModel.from_pretrained(base, directory)` loads it onto the base HF model and computes the merged
model hybridflow exports beside it. megatron-core fuses what HF keeps apart (`linear_qkv` is q, k and v;
`linear_fc1` is [gate; up]), so one fused adapter becomes one PEFT adapter per HF linear: B's rows split
by the bridge exactly as the fused weight's rows are (the bridge is read with B in the weight's place), and
A shared, since each part's delta `s * B_part A` is the fused delta's rows. An FSDP engine's adapters are
peft's own (`engine/fsdp_lora.py`): on a `transformers` model they are written under their names as they are.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's name for the wrapped causal LM


@torch.no_grad()
def adapter_stage_state(engine) -> dict[str, Tensor]:
    """This stage's adapters, whole (gathered over TP), as `{global module}.lora_A` / `.lora_B` -> tensor."""
    from megatron.core import parallel_state as ps

    from hybridflow.models.sharding import unshard_tensor

    out = {}
    for a in engine.lora.adapted:
        for name, param, spec in (("lora_A", a.module.lora_A, a.a_spec), ("lora_B", a.module.lora_B, a.b_spec)):
            tensor = param.detach()
            if engine.layout.tp > 1 and spec.dim is not None:
                pieces = [torch.empty_like(tensor) for _ in range(engine.layout.tp)]
                dist.all_gather(pieces, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
                tensor = unshard_tensor(pieces, spec)
            out[f"{a.key}.{name}"] = tensor.clone()
    out.update(engine.exchanged_experts(out))  # ep > 1: every rank's experts' adapters (each trains its own)
    return out


# transformers fuses an MoE layer's experts into 3-D parameters (Qwen3-MoE: `mlp.experts.gate_up_proj` [E, 2F, H],
# `mlp.experts.down_proj` [E, H, F]), which peft adapts through `target_parameters`, in this order (peft nests the
# second wrapper around the first: the first's tensors sit under `experts.base_layer`).
EXPERT_PARAMETERS = {"linear_fc1": "mlp.experts.gate_up_proj", "linear_fc2": "mlp.experts.down_proj"}
_EXPERT_ADAPTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.lora_([AB])$")


def expert_peft_tensors(adapters: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """The experts' adapters among `adapters` (every expert's, whole) as peft's `target_parameters` tensors, and
    those parameters' names. Expert e's A_e [r, in] and B_e [out, r] become one A [E r, in] (A_e in rows e r ..)
    and one B [out, r E] (B_e's column k in column k E + e), the layout peft's ParamWrapper reads, whose delta of
    expert e is s * B_e A_e."""
    found: dict[tuple[int, str], dict[int, dict[str, Tensor]]] = {}
    for name, tensor in adapters.items():
        match = _EXPERT_ADAPTER.match(name)
        if match:
            layer, expert, target, side = int(match[1]), int(match[2]), match[3], match[4]
            found.setdefault((layer, target), {}).setdefault(expert, {})[side] = tensor
    targets = sorted({target for _, target in found})
    out = {}
    for (layer, target), experts in found.items():
        ordered = [experts[e] for e in sorted(experts)]
        wrapper = "experts.base_layer" if len(targets) == 2 and target == "linear_fc1" else "experts"
        module = f"{PREFIX}model.layers.{layer}.mlp.{wrapper}"
        out[f"{module}.lora_A.weight"] = torch.cat([t["A"] for t in ordered]).contiguous()
        out[f"{module}.lora_B.weight"] = torch.stack([t["B"] for t in ordered], dim=-1).flatten(1).contiguous()
    return out, [EXPERT_PARAMETERS[t] for t in targets]


def peft_tensors(bridge, adapters: dict[str, Tensor]) -> dict[str, Tensor]:
    """Whole adapters (`adapter_stage_state`, every stage) -> PEFT's tensors under HF module names."""
    out = {}
    for name, b in adapters.items():
        if not name.endswith(".lora_B") or _EXPERT_ADAPTER.match(name):
            continue
        key = name[:-len(".lora_B")]
        a = adapters[key + ".lora_A"]
        for hf_name, part in bridge.megatron_to_hf({key + ".weight": b}, partial=True).items():
            module = PREFIX + hf_name[:-len(".weight")]
            out[f"{module}.lora_A.weight"] = a.clone()  # one copy per HF linear (safetensors shares none)
            out[f"{module}.lora_B.weight"] = part.contiguous()
    return out


def peft_config(lora, hf_modules: list[str], base_path: str, hf_parameters: Optional[list[str]] = None) -> dict:
    """adapter_config.json for `lora` (a `LoRAConfig`) on the HF linears `hf_modules` (e.g. "q_proj") and the
    fused expert parameters `hf_parameters` (`EXPERT_PARAMETERS`)."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "target_modules": sorted(set(hf_modules)), "fan_in_fan_out": False, "use_rslora": False,
              "inference_mode": True, "modules_to_save": None}
    if hf_parameters:
        config["target_parameters"] = list(hf_parameters)
    return config


def fsdp_peft_tensors(engine) -> dict[str, Tensor]:
    """An FSDP engine's adapters (`engine/fsdp_lora.py`, gathered whole on every rank) as PEFT's tensors: on a
    `transformers` model they sit on the HF linears already; on hybridflow's decoder the fused ones (`attn.qkv`,
    `mlp.fc1`) are cut by the bridge as the megatron engine's are."""
    whole = engine.lora.adapters()  # module's base weight name -> (A, B)
    if engine.modeling == "transformers":  # "model." + the causal LM's own names
        return {f"{PREFIX}{name[len('model.'):-len('.weight')]}.lora_{side}.weight": t.contiguous()
                for name, (a, b) in whole.items() for side, t in (("A", a), ("B", b))}
    megatron = {e.generation: e.megatron for e in engine.bridge.entries()}
    adapters = {}
    for name, (a, b) in whole.items():
        key = megatron[name[len("decoder."):]][:-len(".weight")]
        adapters[f"{key}.lora_A"], adapters[f"{key}.lora_B"] = a, b
    return peft_tensors(engine.bridge, adapters)


def export_peft(engine, path: str | Path, base_path: str) -> Optional[Path]:
    """Write the engine's adapters as a PEFT directory at `path` (every rank of the engine calls it: the TP
    gathers and the stage broadcasts, or FSDP's all-gathers; rank 0 writes). Returns the directory on rank 0,
    else None."""
    from safetensors.torch import save_file

    experts: dict[str, Tensor] = {}
    parameters: list[str] = []
    if engine.kind == "fsdp":
        tensors = fsdp_peft_tensors(engine)
    else:
        adapters: dict[str, Tensor] = {}
        for part in engine.each_stage(adapter_stage_state(engine)):
            adapters.update(part)
        tensors = peft_tensors(engine.bridge, adapters) if engine.rank == 0 else {}
        experts, parameters = expert_peft_tensors(adapters) if engine.rank == 0 else ({}, [])
    if engine.rank != 0:
        return None
    modules = [name[len(PREFIX):].split(".")[-3] for name in tensors]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **experts}, str(path / WEIGHTS_FILE))
    config = peft_config(engine.lora.cfg, modules, base_path, parameters)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path
