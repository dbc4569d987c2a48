"""Peak memory and time of one actor update, the output layer unfused and fused (#14 item 4).

    hybridflow bench update_memory [--layers 2] [--batch 8] [--prompt 128] [--response 128]
                                   [--vocab 151936] [--hidden 896] [--compare fused|packing]
                                   [--long-tail] [--json PATH]

A Qwen2.5-0.5B-shaped model (hidden 896, 14 heads / 2 KV heads, vocab
151936, tied embeddings), `--layers` of its 24 layers, random weights, on the
megatron-core engine at tp = 1 in float32 on CPU. The measured span is what
the actor does in a step: old log-probs (forward only), then one PPO
mini-batch update (forward, backward, optimizer step), the second such step
(the first allocates the gradient buffers and Adam's moments, which every
step keeps, so it is not measured). Each variant runs in
a fresh process of its own, so one's allocations cannot hide in the other's
peak; the two run back to back from this script. Peak = the process's VmHWM
during each span (old log-probs; update) minus its resident size before it (Linux).

- unfused: `model.use_fused_kernels=false`: the model's output layer makes
  [b, s, vocab] logits over every position, the log-prob kernel reads the
  response columns.
- fused: the default: the model returns hidden states and the output layer
  runs on the response positions only, fused with the log-prob
  (kernels/fused_linear.py), chunk by chunk, recomputed in the backward.

`--compare packing [--long-tail]` runs padded against packed micro-batches
(`actor.use_dynamic_bsz`; both fused): a packed micro-batch gets the padded
one's token capacity (`--micro` x (prompt + response)) and holds only real
tokens, so a batch with a long tail of response lengths needs fewer, fuller
micro-batches and computes no padding.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import peak_since, reset_peak  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace, variant: str) -> dict:
    """One variant, in this process."""
    import torch

    from hybridflow.config.schema import ActorConfig, OptimConfig, ParallelConfig
    from hybridflow.data import fields as F
    from hybridflow.engine import MegatronEngine
    from hybridflow.models import DecoderConfig
    from hybridflow.parallel.process_group import init_process_group
    from hybridflow.roles import Actor

    torch.manual_seed(0)
    init_process_group("cpu")
    cfg = DecoderConfig(model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                        intermediate_size=args.hidden * 38 // 7,  # 4864 at 896, as Qwen2.5-0.5B
                        num_layers=args.layers, num_heads=14, num_kv_heads=2, head_dim=args.hidden // 14,
                        max_position_embeddings=32768, tie_word_embeddings=True, qkv_bias=True, rope_theta=1e6)
    optim = OptimConfig(lr=1e-6)
    fused, packed = variant != "unfused", variant == "packed"
    engine = MegatronEngine(cfg, ParallelConfig(distributed_optimizer=False), optim, total_steps=10,
                            fused_output=fused)
    with torch.no_grad():  # the engine is built to be loaded (no init of its own): random weights, as an init would
        for name, param in engine.module.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    b, t, r = args.batch, args.prompt, args.response
    g = torch.Generator().manual_seed(1)
    responses = torch.randint(0, args.vocab, (b, r), generator=g)
    lengths = torch.full((b,), r)
    if args.long_tail:  # most responses short, a few at the limit: u^4 puts 3/4 of them under r/3
        lengths = (r * torch.rand(b, generator=g) ** 4).long().clamp(min=8, max=r)
        lengths[0] = r
    response_mask = (torch.arange(r)[None] < lengths[:, None]).long()
    batch = {F.INPUT_IDS: torch.cat([torch.randint(0, args.vocab, (b, t), generator=g), responses * response_mask], 1),
             F.ATTENTION_MASK: torch.cat([torch.ones(b, t, dtype=torch.long), response_mask], 1),
             F.RESPONSES: responses * response_mask, F.RESPONSE_MASK: response_mask}
    # Packed micro-batches get the padded ones' token capacity: the same memory budget.
    budget = args.micro * (t + r) if packed else 0
    actor = Actor(ActorConfig(optim=optim, ppo_mini_batch_size=b, ppo_micro_batch_size=args.micro,
                              use_dynamic_bsz=packed, ppo_max_token_len_per_gpu=budget or 16384), engine)
    adv = torch.randn(b, r, generator=g)
    # A first step allocates what every step keeps (gradient buffers, Adam's moments): not measured.
    actor.update({**batch, **actor.compute_log_probs(batch, args.micro, budget), F.ADVANTAGES: adv}, step=0)
    def peak(fn):
        """(result, peak resident MiB beyond the start, seconds)"""
        base, start = reset_peak(), time.perf_counter()
        out = fn()
        return out, peak_since(base), time.perf_counter() - start

    old, logp_mib, logp_s = peak(lambda: actor.compute_log_probs(batch, args.micro, budget))
    _, update_mib, update_s = peak(lambda: actor.update({**batch, **old, F.ADVANTAGES: adv}, step=1))
    return {"variant": variant, "fused": fused, "real_tokens": int(batch[F.ATTENTION_MASK].sum()),
            "old_log_probs_mib": logp_mib, "update_mib": update_mib, "old_log_probs_s": logp_s,
            "update_s": update_s, "logits_mib": b * (t + r) * args.vocab * 4 / 2**20,
            "old_log_prob_mean": (old[F.OLD_LOG_PROBS] * response_mask).sum().item() / response_mask.sum().item()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--compare", choices=["fused", "packing"], default="fused",
                   help="fused: the output layer unfused vs fused; packing: padded vs packed micro-batches "
                        "(both fused)")
    p.add_argument("--long-tail", action="store_true",
                   help="response lengths with a long tail (most short, one at the limit) instead of all full")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--variant", choices=["unfused", "fused", "packed"], help=argparse.SUPPRESS)  # a child's part
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(measure(args, args.variant)))
        return
    rows = []
    child_args = list(argv if argv is not None else sys.argv[1:])
    if "--json" in child_args:
        i = child_args.index("--json")
        del child_args[i:i + 2]
    variants = ("unfused", "fused") if args.compare == "fused" else ("fused", "packed")
    names = {"unfused": "unfused", "fused": "fused" if args.compare == "fused" else "padded", "packed": "packed"}
    for variant in variants:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, __file__, *child_args, "--variant", variant], env=env, cwd=ROOT,
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the {variant} run failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    tokens = args.batch * (args.prompt + args.response)
    print(f"actor update, Qwen2.5-0.5B-shaped output layer (vocab {args.vocab}, hidden {args.hidden}), "
          f"{args.layers} layers, {args.batch} x ({args.prompt} + {args.response}) positions = {tokens}, "
          f"{rows[0]['real_tokens']} real tokens, float32, CPU")
    print(f"{'variant':10s} {'old log-probs: peak MiB':>24s} {'s':>6s} {'update: peak MiB':>17s} {'s':>6s} "
          f"{'mean old log-prob':>18s}")
    for row in rows:
        print(f"{names[row['variant']]:10s} {row['old_log_probs_mib']:24.0f} "
              f"{row['old_log_probs_s']:6.2f} {row['update_mib']:17.0f} {row['update_s']:6.2f} "
              f"{row['old_log_prob_mean']:18.6f}")
    before, after = rows
    ratio = {k: after[k] / before[k] for k in ("old_log_probs_mib", "old_log_probs_s", "update_mib", "update_s")}
    print(f"{names[after['variant']]} / {names[before['variant']]}: old log-probs peak {ratio['old_log_probs_mib']:.2f}, time {ratio['old_log_probs_s']:.2f}; "
          f"update peak {ratio['update_mib']:.2f}, time {ratio['update_s']:.2f}. "
          f"One [tokens, vocab] float32 logits tensor is {rows[0]['logits_mib']:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
