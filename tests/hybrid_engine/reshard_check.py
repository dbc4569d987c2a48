"""Run by test_reshard.py under `torchrun --nproc-per-node 4`: the switch to generation, all three groupings.

For t=4 -> tg=2, t=4 -> tg=1 and t=2,p=2 -> tg=2: build the engine and one
tg-way generation model per grouping (`hybridflow`, `vanilla`, `full`), take
release the generation weights, take one optimizer step (the generation
weights are now stale), refresh, and
record what the test checks: stale before, equal to shard(full weights, tg)
after, bytes and collectives against the plan, the peak against the shard.
"""
import os
import sys


def run(tp: int, pp: int, tg: int, hf_path: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.hybrid_engine import GROUPINGS
    from hybridflow.hybrid_engine.reshard import GroupedWeights
    from hybridflow.hybrid_engine.tensor_parallel import generation_shard
    from hybridflow.roles import Actor
    from tests.engine.conftest import layout_case

    case = layout_case(hf_path)
    engine = MegatronEngine(case.cfg, ParallelConfig(tp=tp, pp=pp), case.optim, total_steps=10)
    engine.load_hf_checkpoint(hf_path)
    rank, out = engine.rank, {}
    switches = {g: GroupedWeights(engine, tg, g) for g in GROUPINGS}
    for g, weights in switches.items():
        out[g] = {"one_bucket": weights.refresh(), "planned_bytes": weights.plan.bytes_received(rank),
                  "planned_sent": weights.plan.bytes_sent(rank),
                  "shard_bytes": weights.plan.needed_bytes[rank], "mesh": weights.mesh}
    hybridflow = switches["hybridflow"]
    hybridflow.bucket_bytes = 4096  # many small buckets: more collectives, the same bytes
    out["hybridflow"]["small_buckets"] = hybridflow.refresh()
    for g, weights in switches.items():  # switch back to training: the generation weights are freed
        weights.release()
        out[g]["released_numel"] = sum(p.numel() for p in weights.model.parameters())
        refused = []
        for call in (lambda: weights.model(None), lambda: weights.model.forward_cached(None, None)):
            try:
                call()
                refused.append(False)
            except RuntimeError as exc:
                refused.append("released" in str(exc))
        out[g]["released_refused"] = all(refused)
        weights.refresh()  # allocated again, holding the weights before the step below
    Actor(case.actor_cfg, engine).update(case.batch, step=0)
    full = engine.full_state()
    for g, weights in switches.items():
        want = generation_shard(engine.bridge, full, weights.tg_rank, tg)
        gen = dict(weights.model.named_parameters())
        out[g]["stale"] = any(not torch.equal(gen[k], want[k]) for k in want)
        out[g]["after"] = weights.refresh()
        out[g]["fresh"] = gen.keys() == want.keys() and all(torch.equal(gen[k], want[k]) for k in want)
    ps.destroy_model_parallel()
    return out


def main(out_path: str, hf_path: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch
    import torch.distributed as dist

    from hybridflow.engine import cpu_compat
    from hybridflow.parallel import init_process_group

    cpu_compat.apply()  # before megatron-core's first import: its torch.compile wrappers cost seconds
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
