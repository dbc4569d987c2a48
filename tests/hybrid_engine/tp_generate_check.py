"""Run by test_tensor_parallel_generation.py under `torchrun --nproc-per-node 2`: the built-in generator at tg=2.

Each rank holds its generation shard of the tiny model (whole query groups,
[gate_r; up_r], half the padded vocabulary) and generates the same prompts as
the one-rank model in the test: greedy and keyed sampling. Rank 0 writes the
logits, tokens and log-probs to argv[1]; each rank checks that it sampled the
same tokens as its peer (the group must agree, or keyed sampling would diverge).
"""
import os
import sys


def main(out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch
    import torch.distributed as dist

    from hybridflow.parallel import init_process_group
    from hybridflow.rollout import Generator
    from tests.hybrid_engine.test_tensor_parallel_generation import PAD, case, generate_all, shard_decoder

    init_process_group("cpu")
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {}
    for tied in (False, True):
        cfg, bridge, full, batch = case(tied, tp=size)
        model = shard_decoder(cfg, bridge, full, dist.group.WORLD, rank, size)
        got = generate_all(model.eval(), Generator(model, PAD), batch)
        everyone = [None] * size
        dist.all_gather_object(everyone, got["sampled_tokens"])
        assert all(torch.equal(t, everyone[0]) for t in everyone), "ranks of one TP group sampled differently"
        results[tied] = got
    if rank == 0:
        torch.save(results, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
