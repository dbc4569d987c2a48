"""Plain decoder models (Llama/Qwen2/Mistral), HF checkpoints and the HF/Megatron bridge.

Nothing in this package imports torch.distributed: parallelism is applied to
these models from outside (rule 1, docs/conventions.md).
"""
from hybridflow.models.bridge import BRIDGES, LlamaBridge, ParamEntry, get_bridge
from hybridflow.models.checkpoint import (
    load_decoder, load_hf_state_dict, save_decoder, save_hf_checkpoint)
from hybridflow.models.config import DecoderConfig, ModelConfigError
from hybridflow.models.decoder import Decoder
from hybridflow.models.sharding import (
    SHARDING_PLAN, Shard, ShardSpec, padded_vocab_size, shard_tensor, spec_for, unshard_tensor)

__all__ = [
    "BRIDGES", "Decoder", "DecoderConfig", "LlamaBridge", "ModelConfigError", "ParamEntry",
    "SHARDING_PLAN", "Shard", "ShardSpec", "get_bridge", "load_decoder", "load_hf_state_dict",
    "padded_vocab_size", "save_decoder", "save_hf_checkpoint", "shard_tensor", "spec_for",
    "unshard_tensor",
]
