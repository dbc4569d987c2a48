"""hybridflow: a Megatron-centric framework for RL on large language models."""
__version__ = "0.1.0"
