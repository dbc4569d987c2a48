"""Run in the suite's 2-process launch (tests/conftest.py, for test_static_decode.py): the static decode path at tg = 2.

Each rank holds its generation shard of the tiny tensor-parallel test model
(tests/hybrid_engine/test_tensor_parallel_generation.py's `case`) and decodes
with decode="static" (eager on the CPU: the same step a CUDA graph captures,
its all-reduces and vocabulary gathers over gloo), greedy and keyed with EOS
ids that end rows unevenly, so rows move to smaller buckets on the way. Rank 0
writes the outputs to argv[1]; every rank checks its peer sampled the same.
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
    from tests.hybrid_engine.test_tensor_parallel_generation import PAD, case, shard_decoder
    from tests.rollout.test_static_decode import tp_workloads

    init_process_group("cpu")
    rank, size = dist.get_rank(), dist.get_world_size()
    cfg, bridge, full, batch = case(False, tp=size)
    model = shard_decoder(cfg, bridge, full, dist.group.WORLD, rank, size)
    gen = Generator(model.eval(), PAD, decode="static")
    results = {}
    for name, (params, keys) in tp_workloads().items():
        got = gen.generate(batch["ids"], batch["mask"], params, row_keys=keys)
        results[name] = {"responses": got.responses, "response_mask": got.response_mask,
                         "log_probs": got.log_probs, "buckets": sorted(gen.static.states)}
        everyone = [None] * size
        dist.all_gather_object(everyone, got.responses)
        assert all(torch.equal(t, everyone[0]) for t in everyone), f"{name}: ranks sampled differently"
    # A refill that moves one rank's weights only (the allocator's choice after the hybrid engine frees and
    # reallocates a shard): every rank drops its captured steps and captures again, together; a rank doing
    # it alone would run the capture's warm-up collectives without its peers.
    name, (params, keys) = list(tp_workloads().items())[-1]  # the last call's family: only the move counts
    before = gen.static.captures
    if rank == 1:
        with torch.no_grad():
            weight = model.embed.weight
            weight.data = weight.data.clone()
    again = gen.generate(batch["ids"], batch["mask"], params, row_keys=keys)
    assert torch.equal(again.responses, results[name]["responses"]), "a new capture changed the output"
    captured = [None] * size
    dist.all_gather_object(captured, gen.static.captures - before)
    assert captured[0] == captured[1] > 0, f"captures after one rank's weights moved: {captured}"
    if rank == 0:
        torch.save(results, out)
    dist.barrier()  # the process group stays for the launch's next script (tests/run_scripts.py ends it)


if __name__ == "__main__":
    main(sys.argv[1])
