"""Run by test_cp_attention.py under `torchrun --nproc-per-node 2`: GPTModel at cp = 2 against cp = 1.

For each tiny model (Llama-shaped with GQA; the same with a sliding window) both ranks first build it
at cp = 1 (dp = 2, each rank the whole model) and compute the reference: logits of a random batch and
the gradients of a fixed random linear function of them. Then megatron-core's groups are rebuilt at
cp = 2 and the same weights run with each rank fed its load-balanced chunks (`cp_split`):

- "cp2": the engine's CP attention and RoPE as built (logits gathered back with `cp_unsplit`,
  parameter gradients summed over the CP group, as megatron-core's DDP reduces over dp x cp);
- "cp2_rows": RoPE from per-row global positions (`RopePositions.at`, the shared-prompt path);
- "wrong_rope": per-row positions of the naive contiguous split: must not match;
- "contiguous": the naive contiguous split fed as if it were the load-balanced one: must not match;
- "window_ignored" (windowed model): the CP attention without its sliding window: must not match;
- "slice_backward": the K/V gather's backward taking only the rank's slice (no reduce-scatter): the
  gradients must not match.

And "bf16": the GQA model's logits in bfloat16 at cp = 2 against cp = 1.

Rank 0 writes {model: {variant: {"logits": max abs diff, "grads": max over parameters of the max abs diff
over the largest gradient}}} to argv[1].
"""
import json
import sys

MODELS = {
    "llama_gqa": dict(num_heads=4, num_kv_heads=2, layer_windows=[None, None]),
    "sliding_window": dict(num_heads=4, num_kv_heads=1, layer_windows=[6, 6]),
}
SEQ, BATCH = 16, 2


def decoder(overrides):
    from hybridflow.models.config import DecoderConfig

    return DecoderConfig(model_type="mistral" if overrides["layer_windows"][0] else "llama", vocab_size=64,
                         hidden_size=32, intermediate_size=64, num_layers=2, head_dim=8,
                         max_position_embeddings=64, **overrides)


def build(cfg, cp: int, dtype=None):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine.build import RopePositions, build_model, transformer_config
    from hybridflow.engine.distributed import init_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    parallel = ParallelConfig(cp=cp)
    init_model_parallel(parallel)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # megatron-core's named RNG streams (dropout, p = 0)
    rope = RopePositions()
    dtype = dtype or torch.float32
    model = build_model(cfg, transformer_config(cfg, parallel, dtype, "cpu"), cfg.vocab_size,
                        dtype, torch.device("cpu"), rope)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from hybridflow.engine.cp_attention import CpDotProductAttention

    # cp = 1 is megatron-core's own attention (the reference); cp = 2 the engine's
    cores = {type(m) for n, m in model.named_modules() if n.endswith("core_attention")}
    assert cores == {DotProductAttention if cp == 1 else CpDotProductAttention}, cores
    gen = torch.Generator().manual_seed(0)  # the same weights at every cp: parameters in build order
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.data.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model, rope


def run(model, ids, mask, probe):
    """Logits [b, s, V] and the gradients of (logits * probe).sum(), by parameter name."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, None, mask)
    (logits * probe).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check_model(cfg) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.engine import cp_attention
    from hybridflow.parallel.cp_split import cp_positions, cp_split, cp_unsplit

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    probe = torch.randn(BATCH, SEQ, cfg.vocab_size, generator=gen)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # what the engine passes

    model, _ = build(cfg, cp=1)
    ref_logits, ref_grads = run(model, ids, causal, probe)

    model, rope = build(cfg, cp=2)
    group, rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()

    def against_reference(split, positions_of_rows=None):
        local_ids, local_probe = split(ids), split(probe)
        if positions_of_rows is None:
            logits, grads = run(model, local_ids, causal, local_probe)
        else:
            with rope.at(positions_of_rows.expand(BATCH, -1)):
                logits, grads = run(model, local_ids, causal, local_probe)
        parts = [torch.empty_like(logits) for _ in range(2)]
        dist.all_gather(parts, logits, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
        full = cp_unsplit(parts) if split is balanced else torch.cat(parts, 1)
        # gradients relative to each parameter's largest: the CP sum adds the ranks' parts in another order
        return {"logits": (full - ref_logits).abs().max().item(),
                "grads": max(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item()
                             for n in ref_grads)}

    def balanced(x):
        return cp_split(x, 2, rank)[0]

    def contiguous(x):
        return x.chunk(2, dim=1)[rank]

    out = {"cp2": against_reference(balanced),
           "cp2_rows": against_reference(balanced, cp_positions(SEQ, 2, rank)[None]),
           "wrong_rope": against_reference(balanced, torch.arange(rank * SEQ // 2, (rank + 1) * SEQ // 2)[None]),
           "contiguous": against_reference(contiguous)}
    if cfg.layer_windows[0] is not None:
        attentions = [m for m in model.modules() if isinstance(m, cp_attention.CpDotProductAttention)]
        assert len(attentions) == cfg.num_layers
        windows = [m.window for m in attentions]
        for m in attentions:
            m.window = None
        out["window_ignored"] = against_reference(balanced)
        for m, w in zip(attentions, windows):
            m.window = w
    gather = cp_attention._GatherSequence
    original = gather.backward
    try:
        gather.backward = staticmethod(
            lambda ctx, grad: (grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None))
        out["slice_backward"] = against_reference(balanced)
    finally:
        gather.backward = original
    return out


def check_bf16(cfg) -> dict:
    """bf16 logits at cp = 2 against cp = 1 (the float32 softmax of half inputs): max abs diff and the
    logits' largest magnitude."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.parallel.cp_split import cp_split, cp_unsplit

    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        ref = build(cfg, 1, torch.bfloat16)[0](ids, None, causal).float()
        model = build(cfg, 2, torch.bfloat16)[0]
        local = model(cp_split(ids, 2, ps.get_context_parallel_rank())[0], None, causal).float()
    parts = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(parts, local, group=ps.get_context_parallel_group())
    return {"logits": (cp_unsplit(parts) - ref).abs().max().item(), "scale": ref.abs().max().item()}


def main(path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    results = {name: check_model(decoder(overrides)) for name, overrides in MODELS.items()}
    results["bf16"] = check_bf16(decoder(MODELS["llama_gqa"]))
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f)
    ps.destroy_model_parallel()  # the process group stays for the launch's next script
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
