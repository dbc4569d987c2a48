"""Run by test_cost.py under torchrun (2 processes): megatron-core's GPTModel of a tiny Qwen3-MoE, built by the
engine at dp2 x ep2 and at ep1, and each rank's parameter count, routed-expert count and the expert-data-parallel
size megatron-core gives it. Rank 0 writes {"ep1": [...], "ep2": [...]} (one entry per rank) to argv[1]; argv[2]
is the model's config.json (written by the test)."""
import json
import sys


def counts(engine, ep: int) -> dict:
    from megatron.core import parallel_state as ps

    params = [(n, p) for chunk in engine.chunks for n, p in chunk.named_parameters()]
    return {"params": sum(p.numel() for _, p in params),
            "experts": sum(p.numel() for n, p in params if ".experts.local_experts." in n),
            "expert_dp": ps.get_expert_data_parallel_world_size() if ep > 1 else ps.get_data_parallel_world_size()}


def main(out_path: str, config_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import OptimConfig, ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.models.config import DecoderConfig
    from hybridflow.parallel import init_process_group

    init_process_group("cpu")
    cfg = DecoderConfig.from_pretrained(config_path)
    out = {}
    for ep in (1, 2):
        ps.destroy_model_parallel()
        engine = MegatronEngine(cfg, ParallelConfig(ep=ep), OptimConfig(lr=1e-3), make_vocab_size_divisible_by=16)
        mine = counts(engine, ep)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out[f"ep{ep}"] = every
        del engine
    ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
