"""Controller benchmark: what one worker-group call costs beyond the work it does.

    python benchmarks/bench_controller.py [--calls N] [--rows R] [--world W] [--iteration STEPS]

A batch shaped like the demo's rollout batch (R rows x 14 tokens of int64 ids
plus a mask, and per-row lists of prompt strings and rewards) goes through
`group.method(batch)` on a Ray group of W CPU workers and on an in-process
LocalWorkerGroup. The worker method does nothing but time itself, so
`overhead = controller wall time - worker time` is the price of dispatch:
splitting, `ray.put`, the actor calls, `ray.get` and concatenation. Three
calls per variant: an argument-free ONE_TO_ALL (the RPC floor), a DP_SPLIT
returning nothing, and a DP_SPLIT returning a float [rows, 14] tensor (as a
log-prob pass does). Medians over N calls after 3 warm-ups.

`--iteration STEPS` also times real demo GRPO steps with the actor in a
one-process Ray group against the same steps in-process: the controller's
share of an iteration.

`ray x2 put-all` is the same Ray group with every argument sent through
`ray.put` first; the default passes a rank's own chunk by value (Ray inlines
small ones) and puts only arguments that several ranks share.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hybridflow.controller import (Dispatch, LocalWorkerGroup, RayWorkerGroup, ResourcePool, Worker, init_ray,
                                   register)

TOKENS = 14  # response tokens per row in the demo


class _Noop(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> float:
        start = time.perf_counter()
        return time.perf_counter() - start

    @register(Dispatch.DP_SPLIT)
    def consume(self, batch: dict) -> dict:
        start = time.perf_counter()
        return {"seconds": time.perf_counter() - start}

    @register(Dispatch.DP_SPLIT)
    def log_probs(self, batch: dict) -> dict:
        start = time.perf_counter()
        out = torch.zeros(batch["input_ids"].shape[0], TOKENS)
        return {"log_probs": out, "seconds": time.perf_counter() - start}


class _PutEveryArgument(RayWorkerGroup):
    """The alternative measured against: every non-scalar argument goes through ray.put."""

    @staticmethod
    def _put_once(per_rank):
        import ray

        def ref(value):
            return value if value is None or isinstance(value, (bool, int, float, str)) else ray.put(value)

        return [(tuple(ref(a) for a in args), {k: ref(v) for k, v in kw.items()}) for args, kw in per_rank]


def demo_batch(rows: int) -> dict:
    return {"input_ids": torch.randint(0, 16, (rows, TOKENS), dtype=torch.int64),
            "attention_mask": torch.ones(rows, TOKENS, dtype=torch.int64),
            "prompts": [f"What is {i} + {i}?" for i in range(rows)],
            "rewards": [float(i % 2) for i in range(rows)]}


def _worker_seconds(result) -> float:
    seconds = result if isinstance(result, list) else result["seconds"]
    return max(seconds)  # ranks run in parallel: the slowest one bounds the call


def _measure(call, calls: int) -> tuple[float, float]:
    walls, works = [], []
    for i in range(calls + 3):
        start = time.perf_counter()
        result = call()
        wall = time.perf_counter() - start
        if i >= 3:
            walls.append(wall)
            works.append(_worker_seconds(result))
    return statistics.median(walls), statistics.median(works)


def measure_dispatch_overhead(calls: int = 20, rows: int = 256, world: int = 2) -> list[dict]:
    """One row per (group, call): controller wall ms, worker ms and the overhead ms, per call."""
    init_ray()
    batch = demo_batch(rows)
    rows_out = []
    pool = ResourcePool(list(range(world)), "cpu")
    groups = [(f"ray x{world}", RayWorkerGroup(_Noop, pool)),
              (f"ray x{world} put-all", _PutEveryArgument(_Noop, pool)),
              ("local x1", LocalWorkerGroup(_Noop, ResourcePool([0], "cpu")))]
    try:
        for name, group in groups:
            for label, call in (("ONE_TO_ALL ping()", group.ping),
                                ("DP_SPLIT consume(batch)", lambda g=group: g.consume(batch)),
                                ("DP_SPLIT log_probs(batch)", lambda g=group: g.log_probs(batch))):
                wall, work = _measure(call, calls)
                rows_out.append({"group": name, "call": label, "wall_ms": wall * 1e3, "worker_ms": work * 1e3,
                                 "overhead_ms": (wall - work) * 1e3})
    finally:
        for _, group in groups:
            group.shutdown()
    return rows_out


def measure_iteration_overhead(steps: int = 20, warmup: int = 3) -> dict:
    """Median demo training step (GRPO, configs/demo.yaml) on a 1-process Ray group vs in-process.

    Both run the same steps with the same seeds, so the work is identical; the
    difference is what the controller adds per iteration (three DP_SPLIT calls:
    generate, log-probs, update, with their batches through Ray).
    """
    import tempfile
    from pathlib import Path

    from hybridflow.config import load_config
    from hybridflow.trainer.trainer import RLTrainer

    root = Path(__file__).resolve().parents[1]
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        for launcher in ("local", "ray"):
            cfg = load_config(root / "configs/demo.yaml", [f"trainer.output_dir={tmp}", f"trainer.launcher={launcher}"])
            cfg.model.path = str(root / cfg.model.path)
            cfg.data.train_files = [str(root / f) for f in cfg.data.train_files]
            cfg.data.val_files = []
            trainer = RLTrainer(cfg)
            try:
                times = []
                for step in range(1, warmup + steps + 1):
                    start = time.perf_counter()
                    trainer.train_step(step)
                    times.append(time.perf_counter() - start)
                medians[launcher] = statistics.median(times[warmup:])
            finally:
                trainer.shutdown()
    local, ray_ = medians["local"], medians["ray"]
    return {"local_s": local, "ray_s": ray_, "overhead_s": ray_ - local, "fraction": (ray_ - local) / ray_}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="5 calls per variant")
    parser.add_argument("--iteration", type=int, default=0, metavar="STEPS",
                        help="also time STEPS demo training steps on Ray vs in-process")
    args = parser.parse_args()
    calls = 5 if args.quick else args.calls
    rows = measure_dispatch_overhead(calls=calls, rows=args.rows, world=args.world)
    print(f"machine: {os.cpu_count()} cores; batch {args.rows} rows x {TOKENS} tokens int64 (+ mask, 2 lists); "
          f"median of {calls} calls")
    print(f"{'group':>16s} {'call':<26s} {'wall ms':>9s} {'worker ms':>10s} {'overhead ms':>12s}")
    for r in rows:
        print(f"{r['group']:>16s} {r['call']:<26s} {r['wall_ms']:9.2f} {r['worker_ms']:10.3f} {r['overhead_ms']:12.2f}")
    if args.iteration:
        it = measure_iteration_overhead(steps=args.iteration)
        print(f"demo GRPO step (median of {args.iteration}): in-process {it['local_s'] * 1e3:.0f} ms, "
              f"Ray worker group {it['ray_s'] * 1e3:.0f} ms -> controller overhead "
              f"{it['overhead_s'] * 1e3:.0f} ms = {it['fraction']:.1%} of an iteration")


if __name__ == "__main__":
    main()
