"""The one place that builds a rollout engine: the config names it, the factory picks, a worker never does.

    backend = build_backend(cfg.rollout, model, tokenizer, model_path)            # the trainer's workers
    backend, engine = build_with_fallback(RolloutConfig(engine="vllm"), ...)      # the DataFlow API

"builtin" is a `Generator` on `model` itself (an HF model hybridflow's decoder does not build: an
`HFGenerator` on its own code, `hf_generate.py`); "vllm" an in-process vLLM engine
(`vllm_backend.py`) of the same architecture with placeholder weights, which
the caller pushes with `weights.sync_weights` before the first rollout. Both
engines are imported here at module level: neither imports this module, and
`vllm` itself is imported only when a vLLM engine is built. The trainer's
config validation refuses "vllm" when the package is missing;
`build_with_fallback` is the DataFlow API's promise instead
(`Node(engine="vllm")`, `load_hf_model(engine="vllm")`): a warning and the
built-in engine.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

from hybridflow.config.schema import ENGINES, RolloutConfig
from hybridflow.errors import ConfigError
from hybridflow.models.decoder import Decoder
from hybridflow.rollout.backend import RolloutBackend
from hybridflow.rollout.generator import Generator
from hybridflow.rollout.hf_generate import HFGenerator
from hybridflow.rollout.vllm_backend import VLLMBackend, VLLMUnavailable, check_generation_group

__all__ = ["build_backend", "build_with_fallback"]

logger = logging.getLogger(__name__)

_VLLM_MISSING = ("engine='vllm' requested but vLLM is not installed or does not import ({}); falling back to the "
                 "built-in engine")


def build_backend(cfg: RolloutConfig, model: Decoder, tokenizer: Any, model_path: str, seed: int = 0,
                  device: str = "cpu") -> RolloutBackend:
    """The engine `cfg.engine` names, generating for `model`'s architecture (`model_path`: its HF directory).

    "builtin": a `Generator` on `model` itself. "vllm": an in-process vLLM engine of the same architecture
    with placeholder weights; the caller pushes `model`'s with `sync_weights` before the first rollout.
    """
    if cfg.engine not in ENGINES:
        raise ConfigError("rollout.engine", f"{cfg.engine!r} is not one of {list(ENGINES)}")
    if not isinstance(model, Decoder):  # an HF model hybridflow's decoder does not build: its own code
        if cfg.engine != "builtin":
            raise ConfigError("rollout.engine", f"{cfg.engine!r} generates for the models hybridflow's decoder "
                              f"builds; {type(model).__name__} generates on its own code with 'builtin'")
        return HFGenerator(model, tokenizer.pad_token_id, tokenizer)
    if cfg.engine == "builtin":
        generator = Generator(model, tokenizer.pad_token_id, tokenizer)
        generator.record_routes = cfg.record_routes and model.cfg.is_moe  # rollout/routes.py
        return generator
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    tg = model.parallel.size
    if tg > 1:
        check_generation_group(model.parallel.group, tg)
    return VLLMBackend(model_path, tokenizer, dtype=dtype, seed=seed, device=device,
                       bucket_bytes=cfg.weight_bucket_mb * 2**20, tensor_parallel_size=tg)


def build_with_fallback(cfg: RolloutConfig, model: Decoder, tokenizer: Any, model_path: str, seed: int = 0,
                        device: str = "cpu") -> tuple[RolloutBackend, str]:
    """`build_backend`, and the name of the engine built: where vLLM does not import, a warning (logged, and
    a RuntimeWarning at the caller's caller) and the built-in engine. Any other error is raised."""
    try:
        return build_backend(cfg, model, tokenizer, model_path, seed, device), cfg.engine
    except VLLMUnavailable as exc:
        message = _VLLM_MISSING.format(exc)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    builtin = dataclasses.replace(cfg, engine="builtin")
    return build_backend(builtin, model, tokenizer, model_path, seed, device), "builtin"
