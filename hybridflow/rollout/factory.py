"""The one place that builds a rollout engine: the config names it, the factory picks, a worker never does.

    backend = build_backend(cfg.rollout, model, tokenizer, model_path)            # the trainer's workers

"builtin" is a `Generator` on `model` itself; "vllm" an in-process vLLM engine
(`vllm_backend.py`) of the same architecture with placeholder weights, which
the caller pushes with `weights.sync_weights` before the first rollout. Both
engines are imported here at module level: neither imports this module, and
`vllm` itself is imported only when a vLLM engine is built.
"""
from __future__ import annotations

from typing import Any

from hybridflow.config.schema import ENGINES, RolloutConfig
from hybridflow.errors import ConfigError
from hybridflow.models.decoder import Decoder
from hybridflow.rollout.backend import RolloutBackend
from hybridflow.rollout.generator import Generator
from hybridflow.rollout.vllm_backend import VLLMBackend, check_generation_group

__all__ = ["build_backend"]


def build_backend(cfg: RolloutConfig, model: Decoder, tokenizer: Any, model_path: str, seed: int = 0,
                  device: str = "cpu") -> RolloutBackend:
    """The engine `cfg.engine` names, generating for `model`'s architecture (`model_path`: its HF directory).

    "builtin": a `Generator` on `model` itself. "vllm": an in-process vLLM engine of the same architecture
    with placeholder weights; the caller pushes `model`'s with `sync_weights` before the first rollout.
    """
    if cfg.engine not in ENGINES:
        raise ConfigError("rollout.engine", f"{cfg.engine!r} is not one of {list(ENGINES)}")
    if cfg.engine == "builtin":
        return Generator(model, tokenizer.pad_token_id, tokenizer)
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    tg = model.parallel.size
    if tg > 1:
        check_generation_group(model.parallel.group, tg)
    return VLLMBackend(model_path, tokenizer, dtype=dtype, seed=seed, device=device,
                       bucket_bytes=cfg.weight_bucket_mb * 2**20, tensor_parallel_size=tg)

