"""Run by test_reshard.py under `torchrun --nproc-per-node 4`: the grouped switch to generation.

For t=4 -> tg=2, t=4 -> tg=1 and t=2,p=2 -> tg=2: build the engine, the
tg-way generation model, take one optimizer step (the generation weights are
now stale), refresh, and record what the test checks: stale before, equal to
shard(full weights, tg) after, bytes and collectives against the plan.
"""
import os
import sys


def run(tp: int, pp: int, tg: int, hf_path: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.hybrid_engine.reshard import GroupedWeights
    from hybridflow.hybrid_engine.tensor_parallel import generation_shard
    from hybridflow.roles import Actor
    from tests.engine.conftest import layout_case

    case = layout_case(hf_path)
    engine = MegatronEngine(case.cfg, ParallelConfig(tp=tp, pp=pp), case.optim, total_steps=10)
    engine.load_hf_checkpoint(hf_path)
    weights = GroupedWeights(engine, tg)
    one_bucket = weights.refresh()
    weights.bucket_bytes = 4096  # many small buckets: more collectives, the same bytes
    small_buckets = weights.refresh()
    Actor(case.actor_cfg, engine).update(case.batch, step=0)
    want = generation_shard(engine.bridge, engine.full_state(), weights.tg_rank, tg)
    gen = dict(weights.model.named_parameters())
    stale = any(not torch.equal(gen[k], want[k]) for k in want)
    after = weights.refresh()
    fresh = all(torch.equal(gen[k], want[k]) for k in want) and gen.keys() == want.keys()
    rank = engine.layout.rank
    out = {"stale": stale, "fresh": fresh, "one_bucket": one_bucket, "small_buckets": small_buckets,
           "after": after, "planned_bytes": weights.plan.bytes_received(rank)}
    ps.destroy_model_parallel()
    return out


def main(out_path: str, hf_path: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch
    import torch.distributed as dist

    from hybridflow.parallel import init_process_group

    init_process_group("cpu")
    results = {}
    for tp, pp, tg in ((4, 1, 2), (4, 1, 1), (2, 2, 2)):
        got = run(tp, pp, tg, hf_path)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, got)
        results[f"t{tp}p{pp}-tg{tg}"] = everyone
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
