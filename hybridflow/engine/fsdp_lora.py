"""LoRA on the FSDP2 engine through `peft`: adapters injected by `peft.get_peft_model`, then sharded with the model.

`attach(module, cfg, native, seed)` runs on the meta-device model before `fully_shard`: peft replaces each
targeted `nn.Linear` by its `lora.Linear` (the original as `.base_layer`, adapters `lora_A.default` [r, in] and
`lora_B.default` [out, r], each an `nn.Linear`, so `fsdp.block_units` shards them as units of their own) and
freezes every other parameter, so the optimizer holds the adapters only. `PeftLoRA.init` then fills this
rank's chunk of each A from the whole A drawn by the adapter's name (`lora.init_a`, as the megatron engine
draws it: any world size starts from the same adapters) and zeroes B, so step 0 is the base model.

Targets are the megatron engine's names (`actor.lora.target_modules`), mapped to the module names of the model
code that runs: hybridflow's decoder (`attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`) or a `transformers`
Llama-family model (`self_attn.{q,k,v}_proj`, `self_attn.o_proj`, `mlp.{gate,up}_proj`, `mlp.down_proj`); the
dense MLP only (an MoE layer's experts are not targeted).

- The adapters-off reference is `peft`'s `disable_adapter()` (`PeftLoRA.disabled`).
- The generation weights are merged as peft merges, `W + s * B A` (s = alpha / rank), without touching W:
  `MergedShard` is this rank's dim-0 chunk of the merged tensor (its rows of W and of B, A gathered whole), so
  the FSDP gather moves merged chunks of the same size as the base's.
- Names: `base_named` gives the model's tensors under the names the model has without peft (`.base_layer`
  dropped, adapters left out), so the HF loaders, the bridge and the generation model see the base model.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from hybridflow.config.schema import LoRAConfig
from hybridflow.engine.fsdp_comm import chunk_bounds
from hybridflow.engine.lora import init_a

ADAPTER = "default"  # peft's adapter name
# actor.lora.target_modules -> the modules they name, in hybridflow's decoder and in a transformers model
DECODER_TARGETS = {"linear_qkv": ("attn", ("qkv",)), "linear_proj": ("attn", ("proj",)),
                   "linear_fc1": ("mlp", ("fc1",)), "linear_fc2": ("mlp", ("fc2",))}
HF_TARGETS = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "linear_proj": ("self_attn", ("o_proj",)),
              "linear_fc1": ("mlp", ("gate_proj", "up_proj")), "linear_fc2": ("mlp", ("down_proj",))}


def target_regex(names: list[str], native_decoder: bool) -> str:
    """peft's `target_modules` (a regex matched against whole module names) for the megatron names `names`."""
    table = DECODER_TARGETS if native_decoder else HF_TARGETS
    parts = sorted({f"{table[n][0]}\\.({'|'.join(table[n][1])})" for n in names})
    return rf".*\.layers\.\d+\.({'|'.join(parts)})"


def adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A parameter's name as the model has it without peft (`qkv.base_layer.weight` -> `qkv.weight`)."""
    return name.replace(".base_layer.", ".")


def base_named(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name without peft, parameter) of every base parameter of `module` (adapters left out)."""
    for name, param in module.named_parameters():
        if not adapter_param(name):
            yield base_name(name), param


class MergedShard:
    """This rank's dim-0 chunk of an adapted layer's merged weight `W + s * B A`, read as the FSDP gather reads
    a DTensor parameter (`shape`, `to_local()`, `full_tensor()`). B's rows chunk as W's (both have `out`
    rows); A [r, in] is gathered whole, a collective every rank makes in the same order."""

    def __init__(self, layer: nn.Module, scale: float):
        self.layer, self.scale = layer, scale

    @property
    def shape(self) -> torch.Size:
        return self.layer.base_layer.weight.shape

    def _delta(self, b: Tensor, a: Tensor, dtype: torch.dtype) -> Tensor:
        return ((b.float() @ a.float()) * self.scale).to(dtype)

    @torch.no_grad()
    def to_local(self) -> Tensor:
        w = self.layer.base_layer.weight
        a, b = self.layer.lora_A[ADAPTER].weight, self.layer.lora_B[ADAPTER].weight
        local = w.to_local()
        return local + self._delta(b.to_local(), a.full_tensor(), local.dtype)

    @torch.no_grad()
    def full_tensor(self) -> Tensor:
        w = self.layer.base_layer.weight.full_tensor()
        a, b = self.layer.lora_A[ADAPTER].weight, self.layer.lora_B[ADAPTER].weight
        return w + self._delta(b.full_tensor(), a.full_tensor(), w.dtype)


class PeftLoRA:
    """The adapters `peft` put on one FSDP engine's model; `layers`: base weight name -> peft's LoRA layer."""

    def __init__(self, peft_model, cfg: LoRAConfig, layers: dict[str, nn.Module]):
        self.peft, self.cfg, self.layers = peft_model, cfg, layers
        self.scale = cfg.alpha / cfg.rank

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model's forward inside (peft's `disable_adapter`)."""
        with self.peft.disable_adapter():
            yield

    @torch.no_grad()
    def init(self, seed: int) -> None:
        """After `to_empty`: this rank's rows of each A (the whole A drawn by the layer's name) and B zero."""
        for name, layer in self.layers.items():
            a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            start, stop = chunk_bounds(a)
            whole = init_a(name[:-len(".weight")], self.cfg.rank, a.shape[1], seed, a.dtype)
            a.to_local().copy_(whole[start:stop])
            b.to_local().zero_()

    def view(self, name: str, param: Tensor):
        """What generation reads for the base weight `name`: its `MergedShard` when adapted, else `param`."""
        layer = self.layers.get(name)
        return param if layer is None else MergedShard(layer, self.scale)

    def adapters(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Base weight name -> (A, B) whole, on every rank (each an all-gather)."""
        return {name: (layer.lora_A[ADAPTER].weight.full_tensor().detach(),
                       layer.lora_B[ADAPTER].weight.full_tensor().detach())
                for name, layer in self.layers.items()}


def attach(module: nn.Module, cfg: LoRAConfig, native_decoder: bool) -> PeftLoRA:
    """Inject `cfg`'s adapters into `module` (in place, on the meta device, before sharding) and freeze the rest;
    ValueError when the targets match no linear of the model."""
    try:
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import LoraLayer
    except ImportError as exc:
        raise ImportError(f"actor.lora with actor.engine=fsdp builds its adapters with peft ({exc}): "
                          "pip install 'hybridflow[lora]'") from exc

    regex = target_regex(cfg.target_modules, native_decoder)
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=regex,
                        bias="none")
    try:
        peft_model = get_peft_model(module, config)
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise ValueError(f"actor.lora.target_modules: {cfg.target_modules} ({regex}) match no linear of "
                         f"{type(module).__name__}: {exc}") from None
    layers = {f"{name}.weight": m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
    return PeftLoRA(peft_model, cfg, layers)


def adapter_state(state: dict[str, Tensor], lora: Optional[PeftLoRA]) -> dict[str, Tensor]:
    """What a checkpoint of the engine holds: every tensor, or with LoRA only the adapters (the base comes back
    from `model.path`)."""
    return state if lora is None else {k: v for k, v in state.items() if adapter_param(k)}
