"""Fast, memory-lean kernels, each beside its plain-PyTorch reference (rule 10, docs/conventions.md)."""
from hybridflow.kernels.backend import BACKENDS, BackendUnavailable, cpu_extension
from hybridflow.kernels.fused_linear import fused_linear_logprob_entropy, fused_linear_reference
from hybridflow.kernels.gae import discounted_returns, gae, gae_reference
from hybridflow.kernels.logprob import logprob_entropy, logprob_entropy_reference
from hybridflow.kernels.vocab_parallel import vocab_parallel_logprob_entropy

__all__ = [
    "BACKENDS", "BackendUnavailable", "cpu_extension", "discounted_returns",
    "fused_linear_logprob_entropy", "fused_linear_reference", "gae", "gae_reference",
    "logprob_entropy", "logprob_entropy_reference", "vocab_parallel_logprob_entropy",
]
