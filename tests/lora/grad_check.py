"""Run by test_lora_engine.py under torchrun (2 processes): the adapters' gradients at several layouts.

For each layout (tp2, and tp2 with sequence parallelism) the ranks build the LoRA engine from the HF
checkpoint at argv[2], set every adapter to `common.full_adapters` (sharded as the engine shards it), run
one gradient pass, and rank 0 writes each adapter's whole gradient (its pieces gathered from every rank)
and the generation weights the 3D-HybridEngine gathers at tg = 1 to argv[1].
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def adapter_grads(tp: int, pp: int, sp: bool, path: str) -> dict:
    import torch
    import torch.distributed as dist

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.models.sharding import shard_tensor, unshard_tensor
    from tests.engine.conftest import layout_case
    from tests.lora.common import LORA, full_adapters, full_shape, gradient_pass

    case = layout_case(path)
    engine = MegatronEngine(case.cfg, ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp), case.optim,
                            total_steps=10, lora=LORA)
    engine.load_hf_checkpoint(case.path)
    tp_rank = engine.coord.tp
    with torch.no_grad():
        for a in engine.lora.adapted:
            full_a, full_b = full_adapters(a.key, LORA.rank, *full_shape(a, tp))
            a.module.lora_A.copy_(shard_tensor(full_a, a.a_spec, tp_rank, tp))
            a.module.lora_B.copy_(shard_tensor(full_b, a.b_spec, tp_rank, tp))
    gradient_pass(engine, case.batch)
    from hybridflow.config.schema import RolloutConfig
    from hybridflow.hybrid_engine.worker_weights import megatron_generation

    generation = megatron_generation(engine, RolloutConfig(tg=1)).model  # gathered at tg = 1, merged
    generated = {k: v.clone() for k, v in generation.named_parameters()}
    mine = {a.key: (tp_rank, a.module.lora_A.main_grad.clone(), a.module.lora_B.main_grad.clone(), a.a_spec, a.b_spec)
            for a in engine.lora.adapted}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    pieces: dict = {}
    for rank_grads in every:
        for key, (r, ga, gb, a_spec, b_spec) in rank_grads.items():
            pieces.setdefault(key, {})[r] = (ga, gb, a_spec, b_spec)
    out = {}
    for key, by_rank in pieces.items():
        ranks = [by_rank[r] for r in sorted(by_rank)]
        a_spec, b_spec = ranks[0][2], ranks[0][3]
        out[key] = (unshard_tensor([g[0] for g in ranks], a_spec) if a_spec.dim is not None else ranks[0][0],
                    unshard_tensor([g[1] for g in ranks], b_spec) if b_spec.dim is not None else ranks[0][1])
    return {"grads": out, "generation": generated}


def main(out_path: str, hf_path: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    from hybridflow.engine.distributed import init_process_group

    init_process_group("cpu")
    results = {}
    for name, (tp, pp, sp) in {"tp2": (2, 1, False), "tp2_sp": (2, 1, True)}.items():
        ps.destroy_model_parallel()  # each layout's engine sets megatron-core's groups up anew
        results[name] = adapter_grads(tp, pp, sp, hf_path)
    if dist.get_rank() == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
