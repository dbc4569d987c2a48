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

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import cpu_compat
    from hybridflow.engine.build import RopePositions, build_model, transformer_config

    cpu_compat.apply()
    parallel_state.initialize_model_parallel(1, 1)
    for hf_config_path in hf_config_paths:
        cfg = DecoderConfig.from_pretrained(hf_config_path)
        bridge = get_bridge(cfg, divisible_by)
        # The engine's own TransformerConfig and layer spec (QK-norm, experts), on the meta device.
        tcfg = transformer_config(cfg, ParallelConfig(), torch.float32, "cpu", layer_kernels=False)
        model = build_model(cfg, tcfg, bridge.padded_vocab, torch.float32, torch.device("meta"), RopePositions())
        shapes = {k: list(v.shape) for k, v in model.state_dict().items()
                  if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        print(f"SHAPES {hf_config_path}=" + json.dumps(shapes))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
