"""hybridflow: a Megatron-centric framework for RL on large language models."""
__version__ = "0.1.0"

from hybridflow.dataflow import DataFlow, Node  # noqa: E402  (pure Python: no torch at import)

__all__ = ["DataFlow", "Node", "__version__"]
