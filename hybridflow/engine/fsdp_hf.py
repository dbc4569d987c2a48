"""The FSDP2 engine on a Hugging Face `transformers` model: `TransformersFSDPEngine` (`<role>.fsdp.modeling:
transformers`).

`FSDPEngine` shards hybridflow's own decoder; this one shards the model class the checkpoint's config.json
names (`LlamaForCausalLM`, `Qwen2ForCausalLM`, ...), built by `transformers` itself, so a role trains the
exact modelling code the checkpoint was written for (its attention, its RoPE variant), as verl's and
NeMo-RL's FSDP workers do. Everything around the model is `FSDPEngine`'s: the units (each linear layer of
every decoder layer, the layer, an untied embedding and output layer, then the root), the in-place
all-gather, mixed precision and offload, the idle passes, Adam, the LR schedule, torch DCP checkpoints.

- The model is built on the meta device and each rank reads only its dim-0 rows of every tensor from the
  safetensors, by the tensors' own HF names (`fsdp_frozen.load_rows`); the rotary embeddings' buffers are
  recomputed by `transformers` (`fsdp_frozen.init_buffers`).
- Left-padded rows take position ids counted from the attention mask (as hybridflow's decoder does);
  packed and shared-prompt micro-batches pass their block-causal mask as a 4-D boolean attention mask
  (`[b, 1, s, s]`, True = may attend), which `transformers`' SDPA attention takes as given.
- The critic (value_head) is the base model (`AutoModel`: the decoder layers and the final norm) and a
  scalar head starting at zero, as `FSDPEngine`'s.
- The generation layout is HF names: the switch to generation gathers each HF tensor and the bridge fuses
  q/k/v and gate/up into the built-in generator's tensors (`hybrid_engine/fsdp_gather.py`), and the
  HF export is the gathered tensors themselves.
- Dropout is off (`without_dropout`), as in TRL's RL trainers: a token's new/old log-prob ratio must be 1
  at equal weights.

On the architectures the bridge maps (Llama, Qwen2, Mistral) both model codes compute the same function
(tests/engine/test_fsdp_hf.py: logits equal, an update within float32 rounding), and the actor generates on
the built-in engine. Any other architecture `transformers` builds (GPT-2, a Llama with a GELU MLP, ...) runs
too when every role loading it is on this engine (`config.validate.needs_decoder`): `DecoderConfig.foreign`
describes it for the run's planning, the generator is the model's own class (`rollout/hf_generate.py`), and
its checkpoint table and export are its own tensors and config.json (tests/trainer/test_transformers_models.py).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from hybridflow.engine.fsdp import FSDPEngine
from hybridflow.engine.fsdp_frozen import init_buffers, load_rows
from hybridflow.engine.fsdp_lora import base_named
from hybridflow.models.config import DecoderConfig
from hybridflow.models.hf_experts import InMemoryNames, to_checkpoint_names

__all__ = ["TransformersFSDPEngine", "TransformersModel", "transformers_units"]


class TransformersModel(nn.Module):
    """An HF causal LM, or (value_head) its base model and a scalar head, behind the engine's forward:
    (ids, attention mask, positions, allowed mask) -> logits [b, s, vocab] or values [b, s, 1]."""

    def __init__(self, config, value_head: bool = False):
        import transformers

        super().__init__()
        # float32 parameters: the engine's masters (a lower compute dtype is FSDP's mixed-precision cast)
        kind = transformers.AutoModel if value_head else transformers.AutoModelForCausalLM
        self.model = kind.from_config(without_dropout(config), dtype=torch.float32, attn_implementation="sdpa")
        for module in self.model.modules():  # a dropout layer sized by a key the pass above did not name
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        self.head = nn.Linear(config.hidden_size, 1, bias=False) if value_head else None

    def forward(self, ids: Tensor, attention_mask: Optional[Tensor], positions: Optional[Tensor],
                allowed: Optional[Tensor]) -> Tensor:
        if allowed is not None:  # packed or shared-prompt rows: their own block-causal mask, [b, 1, s, s]
            mask = allowed if allowed.dim() == 4 else allowed[:, None]
        else:  # left padding: positions count the real tokens
            mask = attention_mask
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        return self.head(out.last_hidden_state) if self.head is not None else out.logits


def without_dropout(config):
    """`config` with every dropout probability 0 (GPT-2's resid/embd/attn_pdrop, attention_dropout, ...): an
    RL update weighs each token by the ratio of its new log-prob to the old one, which dropout would make
    differ at equal weights (TRL disables it in its RL trainers too); hybridflow's decoder has none."""
    config = copy.deepcopy(config)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def transformers_units(module: TransformersModel) -> list[nn.Module]:
    """`FSDPEngine`'s units on an HF model: the linear layers of each decoder layer (the classes the model
    names in `_no_split_modules`), then the layer; the embedding and the output layer as units of their own
    when they are two tensors (tied, the one tensor stays in the root); a value model's embedding."""
    model = module.model
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    units = [unit for block in blocks for unit in _leaf_matrices(block) + [block]]
    embed = model.get_input_embeddings()
    output = None if module.head is not None else model.get_output_embeddings()
    if output is not None and output.weight is not embed.weight:
        units += [embed, output]
    elif module.head is not None:
        units.append(embed)
    return units


def _leaf_matrices(block: nn.Module) -> list[nn.Module]:
    """The layers of a decoder layer that hold a matrix: `nn.Linear`, GPT-2's `Conv1D` and the like (leaf
    modules with a 2-D weight), each an FSDP unit of its own, as `fsdp.block_units` makes the decoder's."""
    return [m for m in block.modules() if not any(True for _ in m.children())
            and isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2]


class TransformersFSDPEngine(FSDPEngine):
    """`FSDPEngine` on the `transformers` model at `path` (see the module doc); the same interface."""

    modeling = "transformers"

    def __init__(self, path: str | Path, model_cfg: DecoderConfig, optim=None, **kwargs):
        import transformers

        self.path = Path(path)
        self.hf_config = transformers.AutoConfig.from_pretrained(path)
        super().__init__(model_cfg, optim, **kwargs)
        if not self.value_head and self.hf_config.tie_word_embeddings:  # one tensor, used first and last
            model = self.module.model
            if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
                raise RuntimeError("sharding untied the model's tied embedding and output layer")

    def _meta_module(self) -> nn.Module:
        return TransformersModel(self.hf_config, self.value_head)

    def _units(self) -> list[nn.Module]:
        return transformers_units(self.module)

    def _init_buffers(self) -> None:
        init_buffers(self.module.model)

    @property
    def _prefix(self) -> str:
        """What the checkpoint's names add to the module's: a value model's base model sits under its
        causal LM's `base_model_prefix` there."""
        return f"{self.module.model.base_model_prefix}." if self.value_head else ""

    def _generation_params(self) -> dict[str, Tensor]:
        """HF name -> this rank's DTensor parameter (the generation layout of this engine: HF's tensors)."""
        params = {self._prefix + name: p for name, p in base_named(self.module.model)}
        if self.lora is None:
            return params
        return {name: self.lora.view("model." + name[len(self._prefix):], p) for name, p in params.items()}

    def _load(self, read, source) -> None:
        # a value model has no output layer; some tied checkpoints store the embedding again as lm_head
        tied = self.hf_config.tie_word_embeddings
        unused = frozenset({"lm_head.weight"}) if self.value_head or tied else frozenset()
        if self.cfg.native and self.cfg.is_moe:  # per-expert tensors on disk, fused in the model
            read = InMemoryNames(read, self.cfg)
        load_rows(self.module.model, read, str(source), self._prefix, unused)

    def to_checkpoint_names(self, named):
        """(in-memory name, tensor) pairs of this model -> the tensors its checkpoint stores (an MoE layer's
        fused experts, one per expert)."""
        return to_checkpoint_names(named, self.cfg) if self.cfg.native and self.cfg.is_moe else named

    def _generation_to_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return dict(self.to_checkpoint_names(state.items()))  # HF names already
