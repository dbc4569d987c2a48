"""The rollout interface every generation engine implements (`RolloutBackend`).

    backend = build_backend(cfg.rollout, model, tokenizer, model_path)   # factory.py: the config picks
    out = backend.generate(input_ids, attention_mask, params, row_keys=keys)       # -> GenerationOutput
    backend.load_weights(hf_named(actor_model))   # weights.py; only engines with their own copy
    backend.release(); ...train...; backend.resume()

Two engines implement it: the built-in KV-cache `Generator` and vLLM
(`vllm_backend.VLLMBackend`, the `hybridflow[vllm]` extra). The module holds
the protocol alone, so that an engine, the weight streaming (`weights.py`) and
the factory (`factory.py`, the one place that builds an engine) can each
import it without importing one another.
"""
from __future__ import annotations

from typing import Iterable, Optional, Protocol, runtime_checkable

import torch

from hybridflow.rollout.generator import GenerationOutput
from hybridflow.rollout.sampling import SamplingParams

__all__ = ["Named", "RolloutBackend"]

Named = Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class RolloutBackend(Protocol):
    """What the rollout role, the agent loop and the DataFlow path call on a generation engine."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: Optional[torch.Generator] = None,
                 row_keys: Optional[torch.Tensor] = None) -> GenerationOutput:
        """Left-padded prompts [B, T] -> B * params.n rows, prompt-major; row_keys [B] seed each prompt's
        samples so that they do not depend on the batch or rank that generates them."""

    def load_weights(self, named: Named) -> int:
        """Take new weights as (HF name, tensor) pairs, any order, any split into buckets; the bytes taken."""

    def release(self) -> None:
        """Free generation memory while the actor trains (a no-op where the engine cannot)."""

    def resume(self) -> None:
        """Take the memory back before the next rollout (a no-op where `release` is one)."""
