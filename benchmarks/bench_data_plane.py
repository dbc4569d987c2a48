"""Bytes through the driver: a run's token tensors and texts via the object store, or via the driver.

    python benchmarks/bench_data_plane.py [--steps N] [--repeat K] [--config configs/tiny-grpo.yaml]
                                          [--layout apart|colocated] [key=value ...]
    hybridflow bench data_plane

Runs GRPO (configs/tiny-grpo.yaml unless told) on Ray CPU processes under
both data planes (`trainer.data_plane`), in turns in one process, `--repeat`
times each: "object_store" (every token tensor a worker returns, [B, R] and
wider, and the texts stay in the object store: the rollout's, the log-prob
and value passes', the advantages the actor's rank 0 makes from them; the
driver passes references and reads one number a row, `driver_rows.token_rows`)
and "driver" (they go through the driver, the data plane before). Layouts:
`apart`, the actor at DP2 on devices 0-1 and a rollout group apart on devices
2-3 at tg = 2 (4 processes); `colocated`, the actor (and its rollout) at DP2
on 2 processes. Per step of each plane's first run, from the run's metrics:
tensor bytes the driver shipped to the groups (`controller/shipped_bytes`:
the prompts it loads, one number a row, and the row index of the fields left
in the store), received from them (`controller/received_bytes`), their sum
(`controller/driver_bytes`), the weight sync's bytes per rollout rank against
the formula and its seconds (`sync/*`, apart only), and the step's seconds;
then each plane's median step time over the steps after the first of all its
runs (the machine is shared: read the ratio). Every run must give the same
learned metrics (the same computation on the same rows; exit code 1 where
they differ).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "apart": ["trainer.n_devices=4", "trainer.launcher=ray", "placement.training=[0,1]", "placement.reference=[0,1]",
              "placement.rollout=[2,3]", "rollout.tg=2", "trainer.save_every=0", "data.val_files=[]"],
    "colocated": ["trainer.n_devices=2", "trainer.launcher=ray", "trainer.save_every=0", "data.val_files=[]"],
}
KEYS = ("controller/shipped_bytes", "controller/received_bytes", "controller/driver_bytes",
        "sync/bytes_received", "sync/formula_bytes_received", "sync/time_s")


def run(config: str, steps: int, rows_in_store: bool, overrides: list[str], out: Path,
        layout: str = "apart") -> list[dict]:
    from hybridflow.config.loader import load_config
    from hybridflow.trainer import read_metrics
    from hybridflow.trainer.trainer import RLTrainer

    plane = "object_store" if rows_in_store else "driver"
    cfg = load_config(ROOT / config, [f"trainer.output_dir={out}", f"trainer.total_steps={steps}", *LAYOUTS[layout],
                                      f"trainer.data_plane={plane}", "trainer.plot=false", *overrides])
    if not Path(cfg.model.path).is_absolute():
        cfg.model.path = str(ROOT / cfg.model.path)
        cfg.data.train_files = [str(ROOT / f) for f in cfg.data.train_files]
    trainer = RLTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.shutdown()
    return [r for r in read_metrics(summary["run_dir"] / "metrics.jsonl") if r["step"] >= 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--config", default="configs/tiny-grpo.yaml")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="apart")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each plane, in turns")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    every: dict[str, list] = {"via driver": [], "object store": []}
    with tempfile.TemporaryDirectory(prefix="bench-data-plane-") as tmp:
        for i in range(args.repeat):
            for name, store in (("via driver", False), ("object store", True)):
                every[name].append(run(args.config, args.steps, store, args.overrides, Path(tmp) / f"{i}{store}",
                                       args.layout))
    runs = {name: records[0] for name, records in every.items()}
    before, after = runs["via driver"], runs["object store"]
    differ = sorted({a["step"] for records in every.values() for other in records for a, b in zip(before, other)
                     if learned(a) != learned(b)})
    if differ:
        print(f"steps {differ}: the two runs' learned metrics differ")
    where = {"apart": "actor DP2 + rollout apart at tg=2 (4 Ray CPU processes)",
             "colocated": "actor and rollout at DP2 (2 Ray CPU processes)"}[args.layout]
    print(f"{args.config}, {where}, {args.steps} steps; KiB per step")
    print(f"{'step':>4} {'rows via':<13} {'shipped':>9} {'received':>9} {'driver':>9} {'vs before':>9} "
          f"{'sync KiB/rank':>13} {'formula':>8} {'sync s':>7} {'step s':>7}")
    for a, b in zip(before, after):
        for name, r in (("driver", a), ("object store", b)):
            kib = {k: r.get(k, 0.0) / 1024 for k in KEYS if "bytes" in k}
            ratio = r["controller/driver_bytes"] / a["controller/driver_bytes"]
            print(f"{r['step']:>4} {name:<13} {kib['controller/shipped_bytes']:9.1f} "
                  f"{kib['controller/received_bytes']:9.1f} {kib['controller/driver_bytes']:9.1f} {ratio:8.2f}x "
                  f"{kib['sync/bytes_received']:13.1f} {kib['sync/formula_bytes_received']:8.1f} "
                  f"{r.get('sync/time_s', 0.0):7.3f} {r['timing/step_s']:7.3f}")
    if len(before) > 1:  # the first step pays for the processes' warm-up
        times = {name: statistics.median(r["timing/step_s"] for records in runs_of for r in records[1:])
                 for name, runs_of in every.items()}
        print(f"median step s after the first ({args.repeat} run(s) of each, in turns): via driver "
              f"{times['via driver']:.3f}, object store {times['object store']:.3f} "
              f"({times['object store'] / times['via driver']:.2f}x)")
    return 1 if differ else 0


def learned(record: dict) -> dict:
    """A step's learned metrics (rewards, the actor's and critic's figures, lengths)."""
    return {k: v for k, v in record.items() if k.startswith(("reward/", "actor/", "critic/", "response/"))}


if __name__ == "__main__":
    sys.exit(main())
