"""Peak memory and time of the actor's update on one long sequence at context parallelism 1, 2 and 4 (#41 item 6).

    hybridflow bench long_context [--seq 8192] [--cps 1,2,4] [--layers 2] [--hidden 256]
                                  [--cap-mib N] [--json PATH]

One sequence of `--seq` tokens (128 of prompt, the rest response) through the megatron-core engine at
tp = pp = dp = 1 and cp = c, on c gloo processes of one `torchrun` each (float32, CPU, a Llama-shaped model
of `--layers` layers, hidden `--hidden`, 4 heads / 2 KV heads, random weights). Each rank measures, over the
second update (the first allocates the gradient buffers and Adam's moments every step keeps):

- activations: the bytes autograd saves for the backward pass during the forward (a saved-tensor hook
  counts each storage once, parameters left out). With one micro-batch they are all alive at the end of the
  forward: this is the update's peak activation memory, exact and the same on every run;
- peak MiB: the process's resident high-water mark during the update above its resident size before it
  (what the activations, their gradients and the temporaries of the backward take on top);
- seconds of the update (old log-probs, then one PPO step).

`--cap-mib N` caps each rank's address space at its size before the first update plus N MiB
(RLIMIT_AS); an allocation past it fails as an out-of-memory on a device does, and the row says "OOM".
The cp rows run one after another, each in processes of their own, so one layout's memory cannot hide in
another's. The expected activation ratio from the planner's cost model (`planner/cost.py`) is printed
beside the measured one.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import peak_since, reset_peak, torchrun_json, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 128


def model_config(args):
    from hybridflow.models import DecoderConfig

    return DecoderConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 8 // 3, num_layers=args.layers, num_heads=4,
                         num_kv_heads=2, head_dim=args.hidden // 4, max_position_embeddings=max(32768, args.seq))


class SavedBytes:
    """Bytes autograd saves for backward while active (each storage once, parameters left out)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t):
        import torch

        if not (t.is_leaf and t.requires_grad) and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def rank_main(args) -> None:
    """One CP rank (under torchrun): build, warm up, measure; rank 0 prints every rank's figures."""
    import torch
    import torch.distributed as dist

    from hybridflow.config.schema import ActorConfig, OptimConfig, ParallelConfig
    from hybridflow.data import fields as F
    from hybridflow.engine import MegatronEngine
    from hybridflow.parallel.process_group import init_process_group
    from hybridflow.roles import Actor

    torch.manual_seed(0)
    init_process_group("cpu")
    cp = dist.get_world_size()
    cfg = model_config(args)
    optim = OptimConfig(lr=1e-6)
    engine = MegatronEngine(cfg, ParallelConfig(cp=cp, distributed_optimizer=False), optim, total_steps=10,
                            fused_output=True)
    with torch.no_grad():  # random weights, the same on every rank (built to be loaded: no init of its own)
        for name, param in engine.module.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    g = torch.Generator().manual_seed(1)
    r = args.seq - PROMPT
    responses = torch.randint(0, args.vocab, (1, r), generator=g)
    batch = {F.INPUT_IDS: torch.cat([torch.randint(0, args.vocab, (1, PROMPT), generator=g), responses], 1),
             F.ATTENTION_MASK: torch.ones(1, args.seq, dtype=torch.long), F.RESPONSES: responses,
             F.RESPONSE_MASK: torch.ones(1, r, dtype=torch.long)}
    adv = torch.randn(1, r, generator=g)
    actor = Actor(ActorConfig(optim=optim, ppo_mini_batch_size=1, ppo_micro_batch_size=1), engine)
    if args.cap_mib:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        cap = size + args.cap_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    row = {"cp": cp, "rank": dist.get_rank()}
    try:
        actor.update({**batch, **actor.compute_log_probs(batch, 1), F.ADVANTAGES: adv}, step=0)
        saved = SavedBytes()
        base, start = reset_peak(), time.perf_counter()
        old = actor.compute_log_probs(batch, 1)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            metrics = actor.update({**batch, **old, F.ADVANTAGES: adv}, step=1)
        row.update(seconds=time.perf_counter() - start, peak_mib=peak_since(base),
                   activation_mib=saved.total / 2**20, loss=metrics.get("actor/pg_loss"), oom=False)
    except (MemoryError, RuntimeError) as exc:  # the cap (an allocation past RLIMIT_AS)
        if "alloc" not in str(exc).lower() and not isinstance(exc, MemoryError):
            raise
        row.update(oom=True, error=str(exc).splitlines()[0][:120])
    rows = [None] * cp
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def run_cp(args, cp: int, argv: list[str]) -> list[dict]:
    return torchrun_json(__file__, cp, [*argv, "--rank-part"], ROOT)


def predicted_activation_ratio(args, cp: int) -> float:
    """The cost model's activations at cp over cp = 1 (logits left out: the fused output layer holds none)."""
    from hybridflow.parallel.layout import ParallelDims
    from hybridflow.planner import cost

    cfg = model_config(args)
    at = lambda c: cost.activation_bytes(cfg, ParallelDims(tp=1, pp=1, dp=1, cp=c), 1, args.seq, 1, 4,
                                         logits=False)
    return at(cp) / at(1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--cap-mib", type=int, default=0, help="cap each rank's memory at this many MiB (RLIMIT_AS)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--rank-part", action="store_true", help=argparse.SUPPRESS)  # a torchrun rank's part
    args = p.parse_args(argv)
    if args.rank_part:
        rank_main(args)
        return
    child = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--json" in child:
        i = child.index("--json")
        del child[i:i + 2]
    cps = [int(c) for c in args.cps.split(",")]
    print(f"actor update on one sequence of {args.seq} tokens ({PROMPT} prompt), Llama-shaped, {args.layers} "
          f"layers, hidden {args.hidden}, 4 heads / 2 KV heads, float32, CPU, gloo"
          + (f"; each rank capped at +{args.cap_mib} MiB" if args.cap_mib else ""))
    print(f"{'cp':>3s} {'activations MiB/rank':>21s} {'vs cp1':>7s} {'model says':>11s} {'peak MiB/rank':>14s} "
          f"{'vs cp1':>7s} {'update s':>9s}")
    results, base = [], None
    for cp in cps:
        ranks = run_cp(args, cp, child)
        if any(r["oom"] for r in ranks):
            print(f"{cp:3d} {'OOM at the cap: ' + ranks[0].get('error', '') if ranks[0]['oom'] else 'OOM'}")
            results.append({"cp": cp, "oom": True})
            continue
        act = max(r["activation_mib"] for r in ranks)
        peak = max(r["peak_mib"] for r in ranks)
        secs = max(r["seconds"] for r in ranks)
        if cp == 1 or base is None:
            base = {"act": act, "peak": peak} if cp == 1 else None
        rel = lambda v, k: f"{v / base[k]:.2f}" if base else "-"
        print(f"{cp:3d} {act:21.1f} {rel(act, 'act'):>7s} {predicted_activation_ratio(args, cp):11.2f} "
              f"{peak:14.1f} {rel(peak, 'peak'):>7s} {secs:9.2f}")
        results.append({"cp": cp, "oom": False, "activation_mib": act, "peak_mib": peak, "seconds": secs,
                        "predicted_activation_ratio": predicted_activation_ratio(args, cp), "ranks": ranks})
    if args.json:
        write_json(args.json, {"seq": args.seq, "layers": args.layers, "hidden": args.hidden,
                               "cap_mib": args.cap_mib, "rows": results})


if __name__ == "__main__":
    main()
