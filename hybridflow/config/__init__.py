"""Typed configuration for hybridflow: schema, YAML loading, overrides, validation, and the run plan."""
from hybridflow.errors import ConfigError
from hybridflow.config.loader import (
    apply_overrides, dump_config, from_dict, load_config, to_dict)
from hybridflow.config.schema import (
    ActorConfig, AlgorithmConfig, Config, CriticConfig, DataConfig, DataflowConfig,
    KLControlConfig, ModelConfig, OptimConfig, ParallelConfig, PlacementConfig,
    ReferenceConfig, RewardConfig, RolloutConfig, TrainerConfig)
from hybridflow.config.plan import RunPlan, devices_for
from hybridflow.config.validate import check_runnable, validate

__all__ = [
    "ActorConfig", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "DataflowConfig", "KLControlConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "PlacementConfig", "ReferenceConfig", "RewardConfig", "RolloutConfig", "RunPlan", "TrainerConfig",
    "apply_overrides", "check_runnable", "devices_for", "dump_config", "from_dict", "load_config", "to_dict",
    "validate",
]
