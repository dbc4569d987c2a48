"""Run by test_experts.py under torchrun (the 4-process launch): the engine at tp2 x ep2 (sequence parallelism;
dp 2, each layer's experts split over the two DP ranks, each expert TP-split), from an HF Qwen3-MoE checkpoint.

- the HF export (TP, then expert-parallel gathers) equals the checkpoint;
- the training forward (tokens dispatched to the rank holding their experts) gives the plain decoder's logits,
  and does not once each rank holds its peer's experts instead (the check fails when a token reaches the
  wrong expert's rank);
- the generation model at tg = 1 and tg = 2 (the other rank's experts gathered, then the 3D-HybridEngine's
  grouped gather) gives the plain decoder's greedy tokens, and the bytes each switch receives.
(Training at expert parallelism is compared with one process through the trainer: test_moe_layouts.py.)

Rank 0 writes the results to argv[1]; argv[2] is the HF checkpoint (the plain decoder's weights).
"""
import sys


def main(out_path: str, hf_path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import OptimConfig, ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.hybrid_engine.reshard import generation_weights
    from hybridflow.models.checkpoint import load_decoder, load_hf_state_dict
    from hybridflow.parallel import init_process_group
    from hybridflow.rollout import Generator, SamplingParams
    from tests.engine.conftest import rl_batch

    init_process_group("cpu")
    ps.destroy_model_parallel()  # whatever layout ran before in this launch
    dec = load_decoder(hf_path).eval()
    engine = MegatronEngine(dec.cfg, ParallelConfig(tp=2, ep=2, sequence_parallel=True), OptimConfig(lr=1e-3))
    engine.load_hf_checkpoint(hf_path)
    out = {"export": engine.hf_state_dict()}
    batch = rl_batch(dec.cfg.vocab_size)
    real = batch["attention_mask"].bool()
    want = dec(batch["input_ids"], batch["attention_mask"])[real]
    out["logits_gap"] = _logits_gap(engine, batch, want)
    _swap_experts(engine)  # each rank now holds its peer's experts under its own numbers
    out["swapped_logits_gap"] = _logits_gap(engine, batch, want)
    engine.load_hf_checkpoint(hf_path)
    prompts, mask = batch["input_ids"][:, :5], batch["attention_mask"][:, :5]
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    out["want"] = Generator(dec, 0, decode="python").generate(prompts, mask, greedy).responses
    for tg in (1, 2):
        gen = generation_weights(engine, tg)
        metrics = gen.refresh()
        out[f"tg{tg}"] = {"tokens": Generator(gen.model, 0, decode="python").generate(prompts, mask, greedy).responses,
                          **{k: v for k, v in metrics.items() if "bytes" in k}}
        gen.release()
    ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(out, out_path)
    dist.barrier()


def _logits_gap(engine, batch, want) -> float:
    """The largest |engine logit - decoder logit| over the real tokens, this rank's and its peers' (all ranks
    run the same batch; the dispatcher sends each token to the rank that holds its experts; each TP rank
    computes its part of the vocabulary)."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    out = engine.run([batch], lambda o, mb: (o.new_zeros(()), {"logits": o}), forward_only=True)[0]["logits"]
    pieces = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    out = torch.cat(pieces, -1)  # the vocabulary is split over TP
    gap = (out[..., :want.shape[-1]][batch["attention_mask"].bool()] - want).abs().max().reshape(1)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap)


def _swap_experts(engine) -> None:
    """Every rank's experts replaced by its expert-parallel peer's (ep = 2), each under this rank's local
    numbers: the model a dispatcher that sent tokens to the wrong rank would compute."""
    import torch

    from hybridflow.engine.distributed import expert_group
    from hybridflow.engine.experts import exchange_experts

    shard, params = engine.experts, engine.named_params()
    own = {shard.global_name(k): v for k, v in params.items()}
    peer = shard.peer(1 - shard.rank)
    with torch.no_grad():
        for name, tensor in exchange_experts(own, shard, expert_group(shard.ep)).items():
            params[peer.local(name)].copy_(tensor)


if __name__ == "__main__":
    main(*sys.argv[1:])
