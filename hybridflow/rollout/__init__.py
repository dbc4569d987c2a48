"""Rollout engines behind one interface (`backend.py`): the built-in batched KV-cached generator on the plain
decoder, and vLLM (`vllm_backend.py`, an optional extra)."""
from hybridflow.rollout.backend import ENGINES, RolloutBackend, build_backend, hf_named, sync_weights
from hybridflow.rollout.generator import GenerationOutput, Generator
from hybridflow.rollout.sampling import SamplingParams, sample, truncate

__all__ = ["ENGINES", "GenerationOutput", "Generator", "RolloutBackend", "SamplingParams", "build_backend",
           "hf_named", "sample", "sync_weights", "truncate"]
