"""LoRA against full fine-tuning: a rank's trained state, the weight syncs' bytes, the step time (issue 62 item 7).

    hybridflow bench lora [--model models/smollm2-135m-instruct] [--ranks 8,64] [--rows 8] [--seq 64]
                          [--steps 3] [--no-tp] [--only-syncs] [--json PATH]

Memory, one process (tp = pp = dp = 1, float32, CPU): the megatron-core engine built for full fine-tuning and
for LoRA at each rank (every linear_qkv, linear_proj, linear_fc1, linear_fc2 adapted), one update run so that
every buffer exists, then its real tensors summed: parameters, gradients (the DDP buffer's `main_grad` of the
parameters that train), Adam's moments, and the KL reference (full: a second, frozen engine built from the
same checkpoint; LoRA: none, the reference is the actor with its adapters off). "Trained state" is
gradients + optimizer state (what a weight costs because it trains). The same table for Qwen2.5-7B is
projected with the planner's per-parameter costs (bf16 weights, fp32 gradients, Adam with fp32 master
weights: `planner/cost.py`) applied to its full parameter count and to its adapters' count, which this script
computes from the model's shapes (the planner has no LoRA term).

Syncs: bytes one rollout rank receives per weight sync, full fine-tuning against LoRA's first sync (the base
and the adapters) and later ones (the adapters alone), from the plans the syncs run (`hybrid_engine/apart.py`,
`lora_sync.py`; the counted bytes equal them in tests/lora/test_lora_sync.py) for a rollout group apart; and
counted on t gloo processes for the colocated 3D-HybridEngine at tp = t -> tg = 1, t the smallest of 2, 3, 4
that divides the model's attention and KV heads (`--no-tp` skips it; `--only-syncs` prints the sync tables
alone).

Step time: the median over `--steps` updates (forward + backward + Adam step) of `--rows` rows of `--seq`
tokens, each configuration in turn in this one process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import torchrun_json, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
PROJECTED = "Qwen2.5-7B-Instruct"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def batch_of(vocab: int, rows: int, seq: int):
    import torch

    from hybridflow.data import fields as F

    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    return {F.INPUT_IDS: ids, F.ATTENTION_MASK: torch.ones_like(ids)}


def build(model: str, rank: int):
    """The one-process engine of `model`: full fine-tuning (rank 0) or LoRA at `rank`."""
    from hybridflow.config.schema import LoRAConfig, OptimConfig, ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.models.config import DecoderConfig

    cfg = DecoderConfig.from_pretrained(model)
    lora = LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules=TARGETS) if rank else None
    engine = MegatronEngine(cfg, ParallelConfig(distributed_optimizer=False), OptimConfig(lr=1e-5),
                            total_steps=100, lora=lora)
    engine.load_hf_checkpoint(model)
    return engine


def loss(out, mb):
    return out.float().logsumexp(-1).mean(), {}


def measure(model: str, rank: int, rows: int, seq: int, steps: int) -> dict:
    """One configuration's tensors (bytes) after an update, and its update time (median seconds)."""
    import torch

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine

    engine = build(model, rank)
    batch = batch_of(engine.cfg.vocab_size, rows, seq)
    times = []
    for _ in range(steps + 1):  # the first allocates Adam's state: not timed
        start = time.perf_counter()
        engine.zero_grad()
        engine.run([batch], loss)
        engine.step()
        times.append(time.perf_counter() - start)
    params = list(engine.module.parameters())
    trained = [p for p in params if p.requires_grad]
    moments = [t for opt in engine.optimizer.chained_optimizers for s in opt.optimizer.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    reference = 0
    if not rank:  # full fine-tuning's KL reference: a frozen engine of its own
        frozen = MegatronEngine(engine.cfg, ParallelConfig(), None)
        frozen.load_hf_checkpoint(model)
        reference = nbytes(frozen.module.parameters())
        del frozen
    row = {"rank": rank, "param_bytes": nbytes(params), "trained_param_bytes": nbytes(trained),
           "grad_bytes": nbytes(p.main_grad for p in trained), "optimizer_bytes": nbytes(moments),
           "reference_bytes": reference, "step_s": statistics.median(times[1:])}
    row["trained_state_bytes"] = row["grad_bytes"] + row["optimizer_bytes"]
    row["total_bytes"] = row["param_bytes"] + row["trained_state_bytes"] + reference
    return row


def projected(rank: int) -> dict:
    """Qwen2.5-7B at tp = pp = dp = 1 with the planner's costs per parameter: bf16 weights, fp32 gradients,
    Adam (fp32 moments and master weights); LoRA trains only its adapters' parameters."""
    import yaml

    from hybridflow.hybrid_engine.lora_sync import adapted_matrices
    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.config import DecoderConfig
    from hybridflow.planner import cost

    spec = yaml.safe_load((ROOT / "hybridflow" / "planner" / "models.yaml").read_text())[PROJECTED]
    cfg = DecoderConfig.from_hf_dict(spec)
    total = cost.total_params(cfg)
    adapters = sum(rank * (m.d_in + m.d_out) for m in adapted_matrices(get_bridge(cfg), TARGETS)) if rank else 0
    trained = adapters if rank else total
    row = {"rank": rank, "param_bytes": cost.weight_bytes(total + adapters, 2),
           "trained_param_bytes": cost.weight_bytes(trained, 2), "grad_bytes": cost.grad_bytes(trained),
           "optimizer_bytes": cost.optimizer_bytes(trained, 2, distributed=False),
           "reference_bytes": 0 if rank else cost.weight_bytes(total, 2)}
    row["trained_state_bytes"] = row["grad_bytes"] + row["optimizer_bytes"]
    row["total_bytes"] = row["param_bytes"] + row["trained_state_bytes"] + row["reference_bytes"]
    return row


def plan_syncs(model: str, rank: int) -> dict:
    """Bytes one rollout rank apart receives per sync (tp = 1 actor, tg = 1 rollout), from the sync's plans."""
    from hybridflow.config.schema import LoRAConfig
    from hybridflow.hybrid_engine.lora_sync import AdapterPlans
    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.config import DecoderConfig
    from hybridflow.parallel.layout import ParallelDims

    bridge = get_bridge(DecoderConfig.from_pretrained(model))
    plans = AdapterPlans(bridge, LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules=TARGETS), 4,
                         ParallelDims(), 1, 1, 64 * 2**20, 1)
    full, adapters = plans.base.bytes_received(1), plans.adapters.bytes_received(1)
    return {"rank": rank, "full": full, "first": full + adapters, "later": adapters,
            "formula": plans.adapters.needed_bytes[0]}


def tp_of(model: str) -> int:
    """The smallest TP size above 1 the model's heads allow."""
    from hybridflow.models.config import DecoderConfig

    cfg = DecoderConfig.from_pretrained(model)
    return next(t for t in (2, 3, 4) if cfg.num_heads % t == 0 and cfg.num_kv_heads % t == 0)


def rank_main(args) -> None:
    """A torchrun rank: tp = t LoRA actor, its generation weights at tg = 1 merged (`MergedWeights`) and by
    adapters (`AdapterGatheredWeights`); each synced twice after its adapters change. Bytes this rank received."""
    import torch
    import torch.distributed as dist

    from hybridflow.config.schema import LoRAConfig, OptimConfig, ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.hybrid_engine.lora_weights import AdapterGatheredWeights, MergedWeights
    from hybridflow.hybrid_engine.reshard import GroupedWeights
    from hybridflow.models.config import DecoderConfig
    from hybridflow.parallel.process_group import init_process_group

    init_process_group("cpu")
    rank = args.rank_part
    cfg = DecoderConfig.from_pretrained(args.model)
    engine = MegatronEngine(cfg, ParallelConfig(tp=args.tp, distributed_optimizer=False), OptimConfig(lr=1e-5),
                            total_steps=10, lora=LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules=TARGETS))
    engine.load_hf_checkpoint(args.model)
    merged = MergedWeights(engine, lambda source: GroupedWeights(source, 1))
    merged_bytes = merged.refresh()["reshard/bytes_received"]
    merged.release()
    del merged
    adapters = AdapterGatheredWeights(engine, 1, 64 * 2**20)
    first = adapters.first["reshard/bytes_received"]
    with torch.no_grad():
        for a in engine.lora.adapted:
            a.module.lora_B.add_(0.01)  # as an update moves them
    later = adapters.refresh()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"full": merged_bytes, "first": first, "later": later["reshard/bytes_received"],
                                  "plan": later["lora/plan_bytes_received"]})
    if dist.get_rank() == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def mib(n: float) -> str:
    return f"{n / 2**20:10.2f}"


def memory_tables(args, ranks: list[int]) -> tuple[list[dict], list[dict]]:
    """The measured per-rank state table (full, then each LoRA rank) and the Qwen2.5-7B projection."""
    print(f"Per-rank state, {Path(args.model).name}, one process, float32, CPU; {args.rows} rows x {args.seq} "
          "tokens a step (MiB)")
    head = (f"{'':10s} {'params':>10s} {'grads':>10s} {'Adam':>10s} {'reference':>10s} {'total':>10s} "
            f"{'trained':>10s} {'trained/full':>12s} {'total/full':>10s}")
    print(head + f" {'step s':>7s} {'step/full':>9s}")
    rows = [measure(args.model, r, args.rows, args.seq, args.steps) for r in [0, *ranks]]
    full = rows[0]
    for row in rows:
        row["trained_ratio"] = row["trained_state_bytes"] / full["trained_state_bytes"]
        row["total_ratio"] = row["total_bytes"] / full["total_bytes"]
        row["step_ratio"] = row["step_s"] / full["step_s"]
        label = f"LoRA r={row['rank']}" if row["rank"] else "full"
        print(f"{label:10s} {mib(row['param_bytes'])} {mib(row['grad_bytes'])} {mib(row['optimizer_bytes'])} "
              f"{mib(row['reference_bytes'])} {mib(row['total_bytes'])} {mib(row['trained_state_bytes'])} "
              f"{row['trained_ratio']:12.4f} {row['total_ratio']:10.3f} {row['step_s']:7.2f} {row['step_ratio']:9.2f}")
    print(f"\nProjected, {PROJECTED}, one rank holding the whole model, bf16 (planner costs; adapters from shapes) (GiB)")
    print(head)
    proj = [projected(r) for r in [0, *ranks]]
    for row in proj:
        row["trained_ratio"] = row["trained_state_bytes"] / proj[0]["trained_state_bytes"]
        row["total_ratio"] = row["total_bytes"] / proj[0]["total_bytes"]
        label = f"LoRA r={row['rank']}" if row["rank"] else "full"
        gib = lambda n: f"{n / 2**30:10.2f}"
        print(f"{label:10s} {gib(row['param_bytes'])} {gib(row['grad_bytes'])} {gib(row['optimizer_bytes'])} "
              f"{gib(row['reference_bytes'])} {gib(row['total_bytes'])} {gib(row['trained_state_bytes'])} "
              f"{row['trained_ratio']:12.4f} {row['total_ratio']:10.3f}")
    return rows, proj


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--ranks", default="8,64", help="LoRA ranks, comma-separated")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-tp", action="store_true", help="skip the counted tp = t -> tg = 1 syncs")
    p.add_argument("--only-syncs", action="store_true", help="the sync tables alone")
    p.add_argument("--tp", type=int, help=argparse.SUPPRESS)  # a torchrun rank's TP size
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--rank-part", type=int, help=argparse.SUPPRESS)  # a torchrun rank's part, at this LoRA rank
    args = p.parse_args(argv)
    if args.rank_part:
        rank_main(args)
        return
    if not Path(args.model).exists():  # a path below the repository, from anywhere
        args.model = str(ROOT / args.model)
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"bench lora: no model at {args.model} (the default is fetched by `hybridflow fetch-model smollm2`)")
    ranks = [int(r) for r in args.ranks.split(",")]
    rows, proj = ([], []) if args.only_syncs else memory_tables(args, ranks)
    print(f"\nBytes per weight sync, one rollout rank apart (tp 1 -> tg 1), from the sync plans (MiB)")
    print(f"{'':10s} {'full':>10s} {'LoRA 1st':>10s} {'LoRA later':>10s} {'later/full':>10s} {'r(din+dout)':>11s}")
    syncs = [plan_syncs(args.model, r) for r in ranks]
    for s in syncs:
        s["later_ratio"] = s["later"] / s["full"]
        print(f"LoRA r={s['rank']:<3d} {mib(s['full'])} {mib(s['first'])} {mib(s['later'])} {s['later_ratio']:10.4f} "
              f"{mib(s['formula'])}")
    counted = []
    if not args.no_tp:
        tp = tp_of(args.model)
        print(f"\nBytes per weight sync, colocated tp {tp} -> tg 1 (the 3D-HybridEngine's gather), counted, rank 0 "
              f"(MiB)")
        print(f"{'':10s} {'full':>10s} {'LoRA 1st':>10s} {'LoRA later':>10s} {'later/full':>10s} {'plan':>10s}")
        for r in ranks:
            got = torchrun_json(__file__, tp, ["--model", args.model, "--rank-part", str(r), "--tp", str(tp)], ROOT)
            c = {"rank": r, "tp": tp, **got[0], "ranks": got}
            c["later_ratio"] = c["later"] / c["full"]
            print(f"LoRA r={r:<3d} {mib(c['full'])} {mib(c['first'])} {mib(c['later'])} {c['later_ratio']:10.4f} "
                  f"{mib(c['plan'])}")
            counted.append(c)
    if args.json:
        write_json(args.json, {"args": vars(args), "memory": rows, "projected": proj, "syncs": syncs,
                               "counted_syncs": counted})


if __name__ == "__main__":
    main()
