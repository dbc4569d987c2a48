"""Switching the actor to generation: the 3D-HybridEngine's three groupings side by side.

    python benchmarks/bench_reshard.py [--quick] [--repeats N] [--bucket-mb MB]
    hybridflow bench reshard
    python benchmarks/bench_reshard.py --tool [--quick] [--model HF_DIR]   (the checkpoint tool)

Starts 4 CPU processes (gloo) itself. A Llama-shaped model of about 100M
parameters is sharded at t = 4 (p = 1, d = 1); for each generation layout
(tg = 2, tg = 1) the three executors of `reshard.GroupedWeights` run on the
same engine, in turn, and the median of `--repeats` is reported:

- `hybridflow`: the paper's grouping. All-gathers inside each micro-DP
  group, in buckets of `--bucket-mb`, straight into the generation shard.
- `vanilla`: HybridFlow-V. The same buckets over the whole TP group, then
  each rank cuts its (consecutive-grouping) shard out.
- `full`: every rank gathers the whole model, one collective per tensor (as
  verl's per-tensor gather does), then cuts its shard out.

Bytes and collectives are what rank 0 received and joined, counted by the
executors (and checked against the plan in tests/hybrid_engine); peak is the
most generation-weight bytes held at once. Ratios are against `full` in the
same run.

Then the apart case (a rollout group on devices of its own,
`hybrid_engine/weight_sync.py`): ranks 0-1 play the training group
(t = 2, or d = 2), ranks 2-3 the rollout group (one replica at tg = 2, or
two at tg = 1), joined by a sync world of their own beside the launch's
(a TCP store and one gloo group per broadcast group, as the trainer builds
it). Each sync broadcasts, in `--bucket-mb` buckets, the slices of the
training shards each rollout rank's generation shard needs. Reported per
sync: seconds, MiB each rollout rank received against the formula (its
generation shard, `M_sharded / tg + M_replicated`) and against the plan,
MiB the busiest training rank sent, collectives per rank. `vs tg1` = the
tg = 1 sync's time / this one's (the whole model into every rollout rank,
what the object-store path it replaced moved too); `exact` = every rollout
rank then holds exactly its generation shard of the senders' model.

Then the expert-parallel case: a Qwen3-MoE-shaped model at t = 2 on the 4
ranks (d = 2), its experts on every rank (ep = 1) or split over the two DP
ranks (ep = 2, `hybrid_engine/expert_weights.py`), switched to tg = 2 and
tg = 1. At ep = 2 a rank first receives the other rank's experts at its TP
shard ((ep - 1) / ep of the experts' bytes / t), then the grouped gather
runs as for a dense model (docs/design.md, "Expert parallelism and its
bytes"); `= form.` says the counted bytes equal that formula, `exact` that
the generation model equals the ep = 1 one bit for bit.

`--tool [--model DIR]` measures the checkpoint resharding tool instead
(`hybridflow reshard`, one process, no torchrun): each conversion of the HF
model at DIR (default: the ~100M-parameter model above, random, written to a
temporary directory) runs in a child process, side by side with two
baselines: the same command with `--dry-run` (imports, the source's index
and the plan: the floor), and a whole-model conversion (`load_hf_state_dict`
then `save_hf_checkpoint`, what a tool that does not stream holds). Peak RSS
is each child's own high-water mark (VmHWM, which the tool prints); "added"
is above the dry run's. `benchmarks/gpu_suite.py` runs it on a
Qwen2.5-0.5B-shaped model.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import struct
import subprocess
import sys
import time

WORLD = 4


def _launch(argv: list[str]) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           os.path.abspath(__file__), *argv]
    return subprocess.run(cmd, env=env).returncode


def _model(quick: bool):
    from hybridflow.models import DecoderConfig

    if quick:
        return DecoderConfig(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688,
                             num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32)
    return DecoderConfig(model_type="llama", vocab_size=16000, hidden_size=1024, intermediate_size=2816,
                         num_layers=6, num_heads=16, num_kv_heads=4, head_dim=64)


def _median_ms(fn, repeats: int) -> tuple[float, dict]:
    times, out = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), out


def run(args) -> None:
    import torch
    import torch.distributed as dist

    from hybridflow.engine import cpu_compat

    cpu_compat.apply()  # before megatron-core's first import: its torch.compile wrappers cost seconds
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.hybrid_engine import GROUPINGS, bridge_params
    from hybridflow.hybrid_engine.reshard import GroupedWeights
    from hybridflow.parallel import init_process_group

    init_process_group("cpu")
    torch.set_num_threads(1)
    cfg = _model(args.quick)
    engine = MegatronEngine(cfg, ParallelConfig(tp=WORLD), None)
    with torch.no_grad():
        for p in engine.named_params().values():
            p.normal_(0, 0.02)
    m = sum(p.nbytes for p in bridge_params(engine.bridge))
    rows = []
    for tg in (2, 1):
        switches = {g: GroupedWeights(engine, tg, g, bucket_bytes=int(args.bucket_mb * 2**20)) for g in GROUPINGS}
        times: dict[str, list[float]] = {g: [] for g in GROUPINGS}
        stats: dict[str, dict] = {}
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every grouping
            for g, switch in switches.items():
                ms, stats[g] = _median_ms(switch.refresh, 1)
                times[g].append(ms)
        for g, switch in switches.items():
            rows.append((tg, g, statistics.median(times[g]), stats[g], switch.plan))
        del switches
    if dist.get_rank() == 0:
        _print(cfg, m, args, rows)
    ps.destroy_model_parallel()
    dist.barrier()
    apart = [_apart(cfg, train, tg, args) for train, tg in APART]
    if dist.get_rank() == 0:
        _print_apart(m, args, apart)
    dist.barrier()
    experts = _experts(args)
    if dist.get_rank() == 0:
        _print_experts(args, experts)
    dist.barrier()


def _moe_model(quick: bool):
    """A Qwen3-MoE-shaped model, 8 experts with 2 chosen per token: ~25M parameters (quick: ~2M)."""
    from hybridflow.models import DecoderConfig

    size = dict(vocab_size=2048, hidden_size=128, num_layers=2, moe_intermediate_size=128) if quick else dict(
        vocab_size=16000, hidden_size=512, num_layers=4, moe_intermediate_size=384)
    return DecoderConfig.from_hf_dict({
        "model_type": "qwen3_moe", "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
        "intermediate_size": 4 * size["hidden_size"], "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "num_hidden_layers": size.pop("num_layers"), **size})


def _experts(args) -> list[dict]:
    """The switch to generation of an MoE actor at tp 2 on 4 ranks (dp 2), its experts on every rank (ep 1)
    or split over the two DP ranks (ep 2), to tg 2 and tg 1: the median refresh, the bytes rank 0 received
    against the formula (the grouped gather's plan, plus (ep - 1) / ep of its TP shard of the experts), and
    whether the generation model equals the ep 1 one's bit for bit (the same HF weights loaded)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.engine.experts import expert_of
    from hybridflow.hybrid_engine.reshard import generation_weights
    from hybridflow.models import Decoder, get_bridge

    cfg = _moe_model(args.quick)
    hf = get_bridge(cfg).generation_to_hf(dict(Decoder(cfg).init_weights(std=0.02, seed=0).state_dict()))
    rows, models = [], {}
    for ep in (1, 2):
        engine = MegatronEngine(cfg, ParallelConfig(tp=2, ep=ep, sequence_parallel=True), None)
        engine.load_hf_state_dict(hf)
        own = sum(p.nbytes for k, p in engine.named_params().items() if expert_of(k) is not None)
        for tg in (2, 1):
            gen = generation_weights(engine, tg)
            ms, stats = _median_ms(gen.refresh, args.repeats)
            plan = gen.inner.plan if ep > 1 else gen.plan
            state = {k: v.clone() for k, v in gen.model.state_dict().items()}
            exact = ep == 1 or all(torch.equal(state[k], models[1, tg][k]) for k in state)
            models[ep, tg] = state
            rows.append({"ep": ep, "tg": tg, "ms": ms, "recv": stats["reshard/bytes_received"],
                         "experts": own * ep, "formula": plan.bytes_received(0) + own * (ep - 1), "exact": exact})
            gen.release()
        ps.destroy_model_parallel()
        dist.barrier()
    return rows


def _print_experts(args, rows: list[dict]) -> None:
    print(f"experts: Qwen3-MoE-shaped, 8 experts top 2, t=2 on {WORLD} CPU processes (d 2), experts on every "
          f"rank (ep1) or split over the 2 DP ranks (ep2), median of {args.repeats}")
    print(f"{'layout':<8} {'tg':>3} {'time ms':>9} {'vs ep1':>7} {'MiB recv':>9} {'formula':>8} {'= form.':>7} "
          f"{'experts MiB':>11} {'exact':>6}")
    base = {r["tg"]: r["ms"] for r in rows if r["ep"] == 1}
    for r in rows:
        same = "yes" if r["recv"] == r["formula"] else "NO"
        print(f"t2-ep{r['ep']:<3} {r['tg']:>3} {r['ms']:9.1f} {base[r['tg']] / r['ms']:6.2f}x {r['recv'] / 2**20:9.2f} "
              f"{r['formula'] / 2**20:8.2f} {same:>7} {r['experts'] / 2**20:11.2f} {'yes' if r['exact'] else 'NO':>6}")


APART = ((dict(tp=2), 2), (dict(tp=2), 1), (dict(dp=2), 2), (dict(dp=2), 1))  # (training layout, rollout tg)


def _apart(cfg, train_kw: dict, tg: int, args) -> dict:
    """One apart layout on this launch's 4 ranks: 0-1 send their training shards of a random model,
    2-3 receive their generation shards; the median sync of `--repeats`, and what rank 2 and 0 moved."""
    import torch
    import torch.distributed as dist

    from hybridflow.hybrid_engine import bridge_params
    from hybridflow.hybrid_engine.apart import plan_apart
    from hybridflow.parallel.stages import layer_index, param_stage
    from hybridflow.hybrid_engine.traffic import Traffic
    from hybridflow.hybrid_engine.weight_sync import SyncWorld, receive, send
    from hybridflow.models import get_bridge, shard_tensor
    from hybridflow.parallel import ParallelDims
    from hybridflow.parallel.process_group import free_port

    rank, train = dist.get_rank(), ParallelDims(**train_kw)
    bridge = get_bridge(cfg, 128, train.tp)
    params = bridge_params(bridge)
    plan = plan_apart(params, train, tg, WORLD - train.world_size, int(args.bucket_mb * 2**20))
    address = [os.environ["MASTER_ADDR"], free_port(os.environ["MASTER_ADDR"]) if rank == 0 else 0]
    dist.broadcast_object_list(address, src=0)
    world = SyncWorld(plan, rank, address[0], address[1], "cpu")
    layers = 1 + max(layer_index(p.name) for p in params if layer_index(p.name) is not None)
    g = torch.Generator().manual_seed(0)
    full = {p.name: torch.randn(p.shape, generator=g) for p in params}  # the same model on every rank
    j = (rank - train.world_size) % tg
    if rank < train.world_size:
        c = train.coord(rank)
        mine = {p.name: shard_tensor(full[p.name], p.spec, c.tp, train.tp)
                for p in params if param_stage(p.name, layers, train.pp) == c.pp}
    else:
        mine = {p.name: torch.full_like(shard_tensor(full[p.name], p.spec, j, tg), float("nan")) for p in params}
    times, traffic = [], Traffic()
    for _ in range(args.repeats):
        traffic = Traffic()
        dist.barrier()
        start = time.perf_counter()
        if rank < train.world_size:
            send(world, mine, traffic)
        else:
            receive(world, mine, torch.float32, traffic)
        dist.barrier()  # a sync is done when the last rank is
        times.append(time.perf_counter() - start)
    # a rollout rank holds exactly its generation shard of the senders' model (NaN nowhere)
    exact = rank < train.world_size or all(torch.equal(mine[p.name], shard_tensor(full[p.name], p.spec, j, tg))
                                           for p in params)
    counts = [None] * WORLD
    dist.all_gather_object(counts, (traffic.bytes_received, traffic.bytes_sent, traffic.collectives, exact))
    n = train.world_size
    return {"train": train, "tg": tg, "s": statistics.median(times), "recv": counts[n][0],
            "exact": all(c[3] for c in counts),
            "formula": plan.needed_bytes[0], "plan": plan.bytes_received(n),
            "sent": max(c[1] for c in counts[:n]), "collectives": max(c[2] for c in counts)}


def _print_apart(m: int, args, rows: list[dict]) -> None:
    print(f"apart: ranks 0-1 train, ranks 2-3 roll out (sync world of 4 gloo processes), bucket {args.bucket_mb} "
          f"MiB, median of {args.repeats}")
    print(f"{'training':<9} {'tg':>3} {'time ms':>9} {'vs tg1':>7} {'MiB recv':>9} {'formula':>8} {'= plan':>6} "
          f"{'MiB sent':>9} {'collect.':>8} {'exact':>6}")
    base = {str(r["train"]): r["s"] for r in rows if r["tg"] == 1}
    for r in rows:
        name = f"t{r['train'].tp}d{r['train'].dp}"
        same = "yes" if r["recv"] == r["plan"] == r["formula"] else "NO"
        print(f"apart-{name:<3} {r['tg']:>3} {1e3 * r['s']:9.1f} {base[str(r['train'])] / r['s']:6.2f}x "
              f"{r['recv'] / 2**20:9.1f} {r['formula'] / 2**20:8.1f} {same:>6} {r['sent'] / 2**20:9.1f} "
              f"{r['collectives']:8d} {'yes' if r['exact'] else 'NO':>6}")


def _print(cfg, m: int, args, rows) -> None:
    params = m // 4
    print(f"model: {params / 1e6:.0f}M parameters ({m / 2**20:.0f} MiB fp32), t={WORLD} -> tg, "
          f"{WORLD} CPU processes, bucket {args.bucket_mb} MiB, median of {args.repeats}")
    print(f"{'tg':>3} {'grouping':<11} {'time ms':>9} {'vs full':>8} {'MiB recv':>9} {'of M':>6} {'= plan':>6} "
          f"{'collect.':>8} {'peak MiB':>9}")
    base = {tg: ms for tg, name, ms, _, _ in rows if name == "full"}
    for tg, name, ms, stats, plan in rows:
        recv = stats["reshard/bytes_received"]
        same = "yes" if recv == plan.bytes_received(0) else "NO"
        print(f"{tg:>3} {name:<11} {ms:9.1f} {base[tg] / ms:7.2f}x {recv / 2**20:9.1f} {recv / m:6.3f} {same:>6} "
              f"{stats['reshard/collectives']:8.0f} {stats['reshard/peak_bytes'] / 2**20:9.0f}")


# --- the checkpoint resharding tool -------------------------------------------

TOOL_RUNS = (  # (label, source key, destination, options)
    ("HF -> hybridflow t2 p2", "hf", "t2p2", ["--to", "hybridflow", "--tp", "2", "--pp", "2"]),
    ("hybridflow t2 p2 -> HF", "t2p2", "hf_back", ["--to", "hf"]),
    ("HF -> HF, 4 files", "hf", "hf_sharded", ["--to", "hf", "--max-shard-size", "{quarter}"]),
    ("HF -> dist (tp 2)", "hf", "dist", ["--to", "dist", "--tp", "2"]),
    ("dist -> HF", "dist", "hf_dist", ["--to", "hf"]),
)
WHOLE = ("from hybridflow.models.checkpoint import load_hf_state_dict as l, save_hf_checkpoint as s; import json, sys;"
         " from hybridflow.reshard.convert import peak_rss;"
         " s(l(sys.argv[1]), json.load(open(sys.argv[1] + '/config.json')), sys.argv[2]);"
         " print(f'peak memory {peak_rss() / 2**20:.0f} MiB')")
PEAK = re.compile(r"peak memory (\d+) MiB")


def _child(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of a child process, the peak as it reports it (its VmHWM: the wait4
    figure would include the pages of this process it was started from)."""
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    found = PEAK.findall(done.stdout)
    return seconds, int(found[-1]) * 2**20 if found else 0


def write_tool_model(path: str, quick: bool) -> None:
    """The ~100M-parameter model (`_model`), random, as an HF checkpoint (run in a child: see run_tool)."""
    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.checkpoint import save_hf_checkpoint
    from hybridflow.models.decoder import Decoder

    cfg = _model(quick)
    dec = Decoder(cfg).init_weights(std=0.02, seed=0)
    save_hf_checkpoint(get_bridge(cfg).generation_to_hf({k: v.detach() for k, v in dec.state_dict().items()}),
                       cfg.to_hf_dict(), path)


def _tensor_bytes(model: str) -> list[int]:
    """Bytes of every tensor of an HF checkpoint, from the safetensors headers (no torch in this process)."""
    index = os.path.join(model, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values())) if os.path.isfile(index)
             else ["model.safetensors"])
    sizes = []
    for name in files:
        with open(os.path.join(model, name), "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        sizes += [b - a for key, v in header.items() if key != "__metadata__" for a, b in [v["data_offsets"]]]
    return sizes


def run_tool(args) -> None:
    """The tool's table: each conversion, its dry run and the whole-model baseline in child processes, each
    reporting its own peak resident memory."""
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tool = [sys.executable, os.path.join(root, "tools", "reshard.py")]
    with tempfile.TemporaryDirectory(prefix="bench-reshard-tool-") as tmp:
        paths = {"hf": args.model or os.path.join(tmp, "hf")}
        if not args.model:
            _child([sys.executable, os.path.abspath(__file__), "--write-tool-model", paths["hf"]]
                   + (["--quick"] if args.quick else []))
        sizes = _tensor_bytes(paths["hf"])
        model, largest = sum(sizes), max(sizes)
        print(f"model: {paths['hf']}: {model / 2**20:.0f} MiB of weights, largest tensor {largest / 2**20:.0f} MiB")
        whole_s, whole = _child([sys.executable, "-c", WHOLE, paths["hf"], os.path.join(tmp, "whole")])
        print(f"{'conversion':<24} {'time s':>7} {'peak MiB':>9} {'dry run':>8} {'added':>7} {'/ model':>8} "
              f"{'/ largest':>9} {'vs whole':>9}")
        for label, src, dst, options in TOOL_RUNS:
            options = [o.format(quarter=str(model // 4 + 1)) for o in options]
            paths[dst] = os.path.join(tmp, dst)
            base = tool + [paths[src], paths[dst], *options, "--no-progress"]
            _, floor = _child(base + ["--dry-run"])
            seconds, peak = _child(base)
            added = max(peak - floor, 0)
            print(f"{label:<24} {seconds:7.1f} {peak / 2**20:9.0f} {floor / 2**20:8.0f} {added / 2**20:7.0f} "
                  f"{added / model:8.2f} {added / largest:9.2f} {peak / whole:8.2f}x")
        print(f"baseline, whole-model HF -> HF (load_hf_state_dict + save_hf_checkpoint): {whole_s:.1f} s, "
              f"peak {whole / 2**20:.0f} MiB; 'vs whole' = peak / this peak")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model (seconds), for tests")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--tool", action="store_true", help="measure the checkpoint resharding tool (one process)")
    parser.add_argument("--model", help="--tool: the HF model to convert (default: a random ~100M-parameter one)")
    parser.add_argument("--write-tool-model", help=argparse.SUPPRESS)  # run_tool's child
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.write_tool_model:
        write_tool_model(args.write_tool_model, args.quick)
        return 0
    if args.tool:
        run_tool(args)
        return 0
    if "WORLD_SIZE" not in os.environ:
        return _launch(sys.argv[1:])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
