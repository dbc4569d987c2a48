"""Rollout engines. The built-in one: batched KV-cached generation on the plain decoder."""
from hybridflow.rollout.generator import GenerationOutput, Generator
from hybridflow.rollout.sampling import SamplingParams, sample, truncate

__all__ = ["GenerationOutput", "Generator", "SamplingParams", "sample", "truncate"]
