"""Prints {name: shape} of a real megatron-core GPTModel built from each HF config given.

    python tests/models/megatron_shapes.py DIVISIBLE_BY HF_DIR [HF_DIR ...]

Run as one subprocess by test_bridge.py for all the model families (one
megatron-core import, not one per family): megatron-core needs a process
group, which the test process should not carry around. One line per
directory: `SHAPES <dir>=<json>`.
"""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")


def main(divisible_by: int, hf_config_paths: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from hybridflow.models import DecoderConfig, get_bridge

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    for hf_config_path in hf_config_paths:
        cfg = DecoderConfig.from_pretrained(hf_config_path)
        bridge = get_bridge(cfg, divisible_by)
        tcfg = TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_heads, num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, add_qkv_bias=cfg.qkv_bias, use_cpu_initialization=True)
        model = GPTModel(
            config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=bridge.padded_vocab, max_sequence_length=cfg.max_position_embeddings,
            position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings)
        shapes = {k: list(v.shape) for k, v in model.state_dict().items()
                  if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        print(f"SHAPES {hf_config_path}=" + json.dumps(shapes))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
