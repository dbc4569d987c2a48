"""The config checks of LoRA (`actor.lora`, `reference.engine: adapters_off`; engine/lora.py builds them on the
megatron engine, engine/fsdp_lora.py through peft on the FSDP engine).

`check_lora` runs with the other config checks (`validate.validate`), `check_lora_model` with those that read
the model's config.json (`validate.check_plan`); each raises a ConfigError naming the key and the value.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.config.schema import LORA_TARGETS, Config
from hybridflow.errors import ConfigError

if TYPE_CHECKING:
    from hybridflow.models.config import DecoderConfig

MLP_TARGETS = ("linear_fc1", "linear_fc2")


def check_lora(cfg: Config) -> None:
    lora = cfg.actor.lora
    if lora.rank < 0:
        raise ConfigError("actor.lora.rank", f"{lora.rank} is negative (0: no adapters, every weight trains)")
    if cfg.reference.engine == "adapters_off" and lora.rank == 0:
        raise ConfigError("reference.engine", "adapters_off is the actor's base model with its LoRA adapters "
                          "switched off: set actor.lora.rank > 0, or use reference.engine=megatron")
    if lora.rank == 0:
        return
    if lora.alpha <= 0:
        raise ConfigError("actor.lora.alpha", f"{lora.alpha} must be positive (the adapters' scale is alpha / rank)")
    if not 0 <= lora.dropout < 1:
        raise ConfigError("actor.lora.dropout", f"{lora.dropout} is not a probability in [0, 1)")
    unknown = [name for name in lora.target_modules if name not in LORA_TARGETS]
    if unknown or not lora.target_modules:
        raise ConfigError("actor.lora.target_modules", f"{lora.target_modules}: each must be one of "
                          f"{list(LORA_TARGETS)} (megatron-core's parallel linears), and at least one given")


def check_lora_model(cfg: Config, model: "DecoderConfig") -> None:
    """The adapters against the model: an MoE model's MLP adapters sit on its experts (the megatron engine at
    tp = 1); a rank must not exceed the smaller side of any adapted matrix (it would add no capacity, only
    parameters)."""
    lora = cfg.actor.lora
    if lora.rank == 0:
        return
    if not model.native:  # the FSDP engine on an architecture only transformers builds
        raise ConfigError("actor.lora.rank", f"{lora.rank} on a {model.model_type!r} model, which hybridflow's "
                          "decoder does not build: adapters target the Llama family's linears (q/k/v/o_proj, "
                          "gate/up/down_proj), which this architecture names otherwise")
    on_experts = model.is_moe and bool(set(lora.target_modules) & set(MLP_TARGETS))
    attention = [t for t in lora.target_modules if t not in MLP_TARGETS] or ["linear_qkv", "linear_proj"]
    if on_experts and cfg.actor.engine == "fsdp":
        raise ConfigError("actor.lora.target_modules", f"{lora.target_modules} with actor.engine=fsdp: peft adapts "
                          "dense linears there, and this model's MLP is its experts (the megatron engine adapts "
                          f"them); use {attention}")
    if on_experts and cfg.actor.parallel.tp > 1:
        raise ConfigError("actor.lora.target_modules", f"{lora.target_modules} adapt the experts, which is not "
                          f"built at actor.parallel.tp={cfg.actor.parallel.tp} (tp = 1 at any ep is); use "
                          f"{attention}")
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    h = model.hidden_size
    f = min(model.intermediate_size, model.moe_intermediate_size) if model.is_moe else model.intermediate_size
    sides = {"linear_qkv": (h, q + 2 * kv), "linear_proj": (q, h), "linear_fc1": (h, 2 * f), "linear_fc2": (f, h)}
    for name in lora.target_modules:
        if lora.rank > min(sides[name]):
            raise ConfigError("actor.lora.rank", f"{lora.rank} exceeds {name}'s smaller side "
                              f"({min(sides[name])} of {sides[name]}); a rank beyond it adds no capacity")
