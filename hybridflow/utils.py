"""What users import to put models into a DataFlow: `from hybridflow.utils import load_hf_model` (docs/api.md).

A module at the top of the layer table (beside the package root): it re-exports `load_hf_model` and the
wrappers it returns from `rollout/hf.py`, so importing it loads torch and the rollout engines. Nothing in
hybridflow imports it; the helpers every layer shares are `hybridflow.common`, a leaf.
"""
from hybridflow.rollout.hf import CausalLM, HFModel, RewardModel, load_hf_model

__all__ = ["CausalLM", "HFModel", "RewardModel", "load_hf_model"]
