"""Run by test_tensor_parallel.py under `torchrun --nproc-per-node 2`: vLLM at tensor parallel 2 inside the job.

On 4 processes the world is two such engines, each its own block of 2 ranks. Each rank holds its tg = 2
generation shard of a random decoder (as the
3D-HybridEngine leaves it) and builds one vLLM rank of a 2-way engine
(`distributed_executor_backend="external_launcher"`, the job's gloo world).
`sync_weights` gathers the shards entry by entry into whole HF tensors, in
1 MiB buckets, into each rank's `load_weights` (vLLM cuts its own shard).
Then, on both ranks: greedy generation against the built-in tg = 2
generator, keyed sampling (the two ranks must agree), and an optimizer step
on the whole model, re-sharded and pushed, against the built-in generator
on the new weights. Rank 0 writes the figures to argv[2] (JSON).
argv[1]: the model's shape; argv[3] == "stale" skips the second push (the test must then fail).
"""
import json
import os
import sys

TG = 2  # each block of TG consecutive ranks of the world is one vLLM engine (more ranks: more engines)


def shard_model(full_model, group, rank: int, size: int):
    """`full_model`'s shard for rank `rank` of the `size`-way `group`, as the 3D-HybridEngine's generation
    model."""
    from hybridflow.models.bridge import get_bridge
    from tests.hybrid_engine.test_tensor_parallel_generation import shard_decoder

    bridge = get_bridge(full_model.cfg, 128, tp=size)
    full = bridge.hf_to_megatron(bridge.generation_to_hf({k: v.detach() for k, v in full_model.state_dict().items()}))
    return shard_decoder(full_model.cfg, bridge, full, group, rank, size).eval().requires_grad_(False)


def main(shape: str, out: str, mode: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch
    import torch.distributed as dist

    from hybridflow.models import save_decoder
    from hybridflow.parallel import init_process_group
    from hybridflow.rollout import Generator, SamplingParams, sync_weights
    from hybridflow.rollout.vllm_backend import VLLMBackend
    from tests.rollout.conftest import left_padded_prompts
    from tests.vllm.test_engine import PAD, STEPS, VOCAB, _Tok, random_decoder

    init_process_group("cpu")
    world, size = dist.get_world_size(), TG
    groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
    group, rank = groups[dist.get_rank() // size], dist.get_rank() % size  # blocks of consecutive ranks
    full_model = random_decoder(shape, seed=3, num_key_value_heads=2)  # one KV head a rank; seeded
    model = shard_model(full_model, group, rank, size)
    path = os.path.join(os.path.dirname(out), "model")
    if dist.get_rank() == 0:
        save_decoder(full_model, path)
    dist.barrier()
    backend = VLLMBackend(path, _Tok(), dtype="float32", max_model_len=128, bucket_bytes=2**20,
                          tensor_parallel_size=size)
    first = sync_weights(backend, model)
    from vllm.distributed.parallel_state import get_tp_group

    engines = [None] * world
    dist.all_gather_object(engines, get_tp_group().ranks)  # vLLM's own TP group, as each rank sees it

    ids, mask = left_padded_prompts(VOCAB, lengths=(9, 4, 1, 7, 30))
    greedy = SamplingParams(max_new_tokens=STEPS, do_sample=False)
    got, want = backend.generate(ids, mask, greedy), Generator(model, PAD).generate(ids, mask, greedy)
    sampled = backend.generate(ids, mask, SamplingParams(max_new_tokens=STEPS, temperature=1.0, n=2),
                               row_keys=torch.arange(5) + 7)
    peers = [None] * world
    dist.all_gather_object(peers, sampled.responses)  # every block generates the same prompts and keys

    optimizer = torch.optim.SGD(full_model.parameters(), lr=2.0)
    loss = -full_model(ids, mask)[:, -1].float().log_softmax(-1)[:, 7].mean()  # make token 7 likelier
    loss.backward()
    optimizer.step()
    full_model.eval()
    model = shard_model(full_model, group, rank, size)  # the 3D-HybridEngine's refill after the update
    second = sync_weights(backend, model) if mode != "stale" else {}
    after, after_want = backend.generate(ids, mask, greedy), Generator(model, PAD).generate(ids, mask, greedy)

    if dist.get_rank() == 0:
        whole = sum(p.numel() * p.element_size() for p in full_model.parameters())
        result = {
            "model_bytes": whole, "first": first, "second": second, "vllm_tp_groups": engines,
            "greedy_equal": torch.equal(got.responses, want.responses)
            and torch.equal(got.response_mask, want.response_mask),
            "distinct_tokens": got.responses.unique().numel(),
            "greedy_logprob_max_diff": (got.log_probs - want.log_probs).abs().max().item(),
            "ranks_sampled_alike": all(torch.equal(p, peers[0]) for p in peers),
            "sampled_tokens": int(sampled.response_mask.sum()),
            "after_push_equal": torch.equal(after.responses, after_want.responses),
            "changed_by_update": not torch.equal(after_want.responses, want.responses),
            "after_logprob_max_diff": (after.log_probs - after_want.log_probs).abs().max().item(),
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "push")
