"""A mixture-of-experts layer at expert parallelism 1 and 2, and MoE decoding against a dense model (issue 60 item 7).

    hybridflow bench moe [--tokens 2048] [--hidden 256] [--experts 8] [--expert-ffn 256] [--top-k 2]
                         [--layers 2] [--steps 3] [--json PATH]

Training rows: the megatron-core engine on 2 gloo processes of one `torchrun` (data parallel 2, float32, CPU),
a Qwen3-MoE-shaped model with random weights (the same on both layouts: each expert seeded by its global
name), each rank updating on its own `--tokens` tokens (rows of 128), at ep = 1 (every rank holds every expert)
and ep = 2 (each holds half; the allgather dispatcher brings both ranks' tokens to them). Per rank:

- parameter + Adam bytes, all and the experts' (target: the experts' at ep 2 <= 0.55 x ep 1's);
- the dispatcher's bytes per update, counted on the expert group's all-gathers and reduce-scatters, beside
  the formula: per MoE layer and pass direction, each rank receives the other ep - 1 ranks' tokens' hidden
  states, routing probabilities and map, and sends back their outputs (`dispatch_bytes`);
- forward + backward tokens per second of the update (both ranks' tokens over the update's wall time).

Decode row: the built-in engine's Python loop, tokens per second of the MoE model beside a dense Llama of
the same active size (its MLP as wide as the top-k experts together), one process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import torchrun_json, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROW = 128


def moe_config(args, dense: bool = False):
    from hybridflow.models import DecoderConfig

    common = dict(vocab_size=2048, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=args.hidden // 4, max_position_embeddings=4096, rms_norm_eps=1e-6)
    if dense:  # the same active size: one MLP as wide as the top-k experts together
        return DecoderConfig.from_hf_dict({**common, "model_type": "llama",
                                           "intermediate_size": args.expert_ffn * args.top_k})
    return DecoderConfig.from_hf_dict({**common, "model_type": "qwen3_moe", "intermediate_size": args.expert_ffn,
                                       "num_experts": args.experts, "num_experts_per_tok": args.top_k,
                                       "moe_intermediate_size": args.expert_ffn, "norm_topk_prob": True})


def dispatch_bytes(args, ep: int, tokens: int) -> int:
    """The allgather dispatcher's bytes one rank receives in one forward + backward of `tokens` tokens, per
    the layout: per layer, forward: the other ep - 1 ranks' hidden states (fp32), routing probabilities
    (fp32) and routing map (bool) gathered, their outputs reduce-scattered back; backward: the hidden states'
    gradients the other way, and the probabilities' gradients."""
    if ep == 1:
        return 0
    other = (ep - 1) * tokens
    h, e = args.hidden, args.experts
    forward = other * (4 * h + 4 * e + e) + other * 4 * h
    backward = other * 4 * h + other * 4 * h + other * 4 * e
    return args.layers * (forward + backward)


class Collectives:
    """Bytes this rank receives in megatron-core's all-gathers and reduce-scatters over more than one rank
    (at tp = 1, no sequence parallelism and no distributed optimizer: the dispatcher's), counted as they run."""

    def __init__(self):
        import torch.distributed as dist
        from megatron.core.tensor_parallel import mappings

        self.bytes = 0
        gather, scatter = mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func

        def gathered(out, inp, group=None, **k):
            size = dist.get_world_size(group)
            self.bytes += inp.numel() * inp.element_size() * (size - 1) if size > 1 else 0
            return gather(out, inp, group=group, **k)

        def scattered(out, inp, group=None, **k):  # each rank sums every rank's slice of its part
            size = dist.get_world_size(group)
            self.bytes += out.numel() * out.element_size() * (size - 1) if size > 1 else 0
            return scatter(out, inp, group=group, **k)
        mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func = gathered, scattered


def rank_main(args, ep: int) -> None:
    import torch
    import torch.distributed as dist

    from hybridflow.config.schema import OptimConfig, ParallelConfig
    from hybridflow.data import fields as F
    from hybridflow.engine import MegatronEngine
    from hybridflow.engine.experts import expert_of
    from hybridflow.parallel.process_group import init_process_group

    init_process_group("cpu")
    cfg = moe_config(args)
    engine = MegatronEngine(cfg, ParallelConfig(ep=ep, distributed_optimizer=False), OptimConfig(lr=1e-4),
                            total_steps=args.steps + 1)
    with torch.no_grad():  # each tensor seeded by its global name: the same model at every ep
        for name, param in engine.module.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                seed = sum(map(ord, engine.experts.global_name(name)))
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(seed))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    rows = args.tokens // ROW
    ids = torch.randint(0, cfg.vocab_size, (rows, ROW), generator=g)
    batch = {F.INPUT_IDS: ids, F.ATTENTION_MASK: torch.ones_like(ids)}

    def loss(out, mb):
        return out.float().logsumexp(-1).mean(), {}

    engine.run([batch], loss)  # warm-up: buffers and Adam state allocated
    engine.step()
    counter = Collectives()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.zero_grad()
        engine.run([batch], loss)
        engine.step()
    seconds = (time.perf_counter() - start) / args.steps
    params = dict(engine.module.named_parameters())
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    experts = {id(p) for n, p in params.items() if expert_of(n) is not None}
    moments = [(id(p), t) for opt in engine.optimizer.chained_optimizers for p, s in opt.optimizer.state.items()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0]  # Adam's two moments per tensor
    state, expert_state = [t for _, t in moments], [t for p, t in moments if p in experts]
    row = {"ep": ep, "rank": rank, "param_bytes": nbytes(params.values()),
           "expert_param_bytes": nbytes(p for n, p in params.items() if expert_of(n) is not None),
           "adam_bytes": nbytes(state), "expert_adam_bytes": nbytes(expert_state),
           "dispatch_bytes": counter.bytes / args.steps, "seconds": seconds, "tokens": args.tokens}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def run_ep(ep: int, argv: list[str]) -> list[dict]:
    return torchrun_json(__file__, 2, [*argv, "--rank-part", str(ep)], ROOT)


def decode_rates(args) -> dict[str, float]:
    """Tokens per second of the built-in engine's Python loop, the MoE model and its dense twin."""
    import torch

    from hybridflow.models import Decoder
    from hybridflow.rollout import Generator, SamplingParams

    out = {}
    ids = torch.randint(1, 2048, (args.decode_batch, 16), generator=torch.Generator().manual_seed(0))
    for name, dense in (("moe", False), ("dense", True)):
        model = Decoder(moe_config(args, dense)).init_weights(std=0.05, seed=0).eval()
        gen = Generator(model, 0, decode="python")
        params = SamplingParams(max_new_tokens=args.decode_tokens, do_sample=False)
        gen.generate(ids, torch.ones_like(ids), SamplingParams(max_new_tokens=4, do_sample=False))  # warm-up
        start = time.perf_counter()
        gen.generate(ids, torch.ones_like(ids), params)
        out[name] = args.decode_batch * args.decode_tokens / (time.perf_counter() - start)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per update (rows of 128)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--rank-part", type=int, help=argparse.SUPPRESS)  # a torchrun rank's part, at this ep
    args = p.parse_args(argv)
    if args.rank_part:
        rank_main(args, args.rank_part)
        return
    child = list(argv if argv is not None else sys.argv[1:])
    if "--json" in child:
        i = child.index("--json")
        del child[i:i + 2]
    print(f"MoE update, 2 ranks (data parallel), {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
          f"of {args.expert_ffn}, top {args.top_k}, {args.tokens} tokens a rank, float32, CPU, gloo")
    print(f"{'ep':>3s} {'params MiB':>11s} {'experts MiB':>12s} {'Adam MiB':>9s} {'experts vs ep1':>15s} "
          f"{'dispatch MiB':>13s} {'formula MiB':>12s} {'tokens/s':>9s}")
    rows, base = [], None
    for ep in (1, 2):
        ranks = run_ep(ep, child)
        r0 = ranks[0]
        experts = r0["expert_param_bytes"] + r0["expert_adam_bytes"]
        base = experts if ep == 1 else base
        tokens_s = sum(r["tokens"] for r in ranks) / max(r["seconds"] for r in ranks)
        formula = dispatch_bytes(args, ep, args.tokens)
        mib = 2 ** 20
        print(f"{ep:3d} {r0['param_bytes'] / mib:11.2f} {r0['expert_param_bytes'] / mib:12.2f} "
              f"{r0['adam_bytes'] / mib:9.2f} {experts / base:15.2f} {r0['dispatch_bytes'] / mib:13.2f} "
              f"{formula / mib:12.2f} {tokens_s:9.0f}")
        rows.append({"ep": ep, "expert_ratio": experts / base, "formula_dispatch_bytes": formula,
                     "tokens_per_s": tokens_s, "ranks": ranks})
    rates = decode_rates(args)
    print(f"decode (built-in engine, Python loop, batch {args.decode_batch}): MoE {rates['moe']:.0f} tokens/s, "
          f"dense of the same active size {rates['dense']:.0f} tokens/s ({rates['moe'] / rates['dense']:.2f}x)")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows, "decode": rates})


if __name__ == "__main__":
    main()
