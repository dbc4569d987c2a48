"""Training engine: megatron-core GPTModel, Megatron DDP and optimizer (docs/design.md §2, §4)."""
from hybridflow.engine.megatron import MegatronEngine, StepStats, TrafficCounter, UnsafeCheckpointError
from hybridflow.engine.packing import left_align_index, unalign

__all__ = ["MegatronEngine", "StepStats", "TrafficCounter", "UnsafeCheckpointError", "left_align_index", "unalign"]
