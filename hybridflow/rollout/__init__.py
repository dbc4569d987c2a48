"""Rollout engines behind one interface (`backend.py`): the built-in batched KV-cached generator on the plain
decoder, and vLLM (`vllm_backend.py`, an optional extra), both built by `factory.py` alone; the actor's
weights reach an engine by `weights.py`.

This file imports only modules that import neither the vLLM engine nor the factory, so that importing any
rollout module (`vllm_backend` included) never runs the factory first: build engines with
`from hybridflow.rollout.factory import build_backend`.
"""
from hybridflow.rollout.backend import RolloutBackend
from hybridflow.rollout.generator import GenerationOutput, Generator
from hybridflow.rollout.sampling import SamplingParams, sample, truncate
from hybridflow.rollout.weights import hf_named, sync_weights

__all__ = ["GenerationOutput", "Generator", "RolloutBackend", "SamplingParams", "hf_named", "sample",
           "sync_weights", "truncate"]
