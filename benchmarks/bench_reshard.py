"""Switching the actor to generation: the 3D-HybridEngine's three groupings side by side.

    python benchmarks/bench_reshard.py [--quick] [--repeats N] [--bucket-mb MB]
    hybridflow bench reshard

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
"""
from __future__ import annotations

import argparse
import os
import statistics
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model (seconds), for tests")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        return _launch(sys.argv[1:])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
