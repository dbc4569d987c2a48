"""hybridflow: a Megatron-centric framework for RL on large language models.

The user-facing names: `from hybridflow import DataFlow, Node` (pure Python: no torch at import), and
`load_hf_model` with the wrappers it returns, which also import as `from hybridflow.utils import
load_hf_model` (docs/api.md). Those load torch and the rollout engines, so the root loads them on first use:
every `import hybridflow.X` runs this file first, and a leaf must not pay for them.
"""
__version__ = "0.1.0"

from hybridflow.dataflow import DataFlow, Node  # noqa: E402

_FROM_ROLLOUT = ("CausalLM", "HFModel", "RewardModel", "load_hf_model")  # what hybridflow.utils re-exports
__all__ = ["DataFlow", "Node", "__version__", *_FROM_ROLLOUT]


def __getattr__(name: str):
    if name in _FROM_ROLLOUT:
        from hybridflow.rollout import hf
        return getattr(hf, name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
