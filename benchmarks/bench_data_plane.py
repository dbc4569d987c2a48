"""Bytes through the driver: a run's token tensors via the object store, or via the driver.

    python benchmarks/bench_data_plane.py [--steps N] [--config configs/tiny-grpo.yaml]
                                          [--layout apart|colocated] [key=value ...]
    hybridflow bench data_plane

Runs GRPO (configs/tiny-grpo.yaml unless told) on Ray CPU processes, twice,
side by side in one process: as built (every token tensor a worker returns,
[B, R] and wider, stays in the object store: the rollout's, the log-prob and
value passes', the advantages the actor's rank 0 makes from them; the driver
passes references and reads one number a row, `rl_workers.token_rows`) and
with them sent through the driver (`Run.rows_in_object_store = False`: the
data plane before). Layouts: `apart`, the actor at DP2 on devices 0-1 and a
rollout group apart on devices 2-3 at tg = 2 (4 processes); `colocated`, the
actor (and its rollout) at DP2 on 2 processes. Per step, from the run's
metrics: tensor bytes the driver shipped to the groups
(`controller/shipped_bytes`: the prompts it loads, and one number a row),
received from them (`controller/received_bytes`), their sum
(`controller/driver_bytes`), and the weight sync's bytes per rollout rank
against the formula and its seconds (`sync/*`, apart only). Both runs must
give the same learned metrics (the same computation on the same rows; the
exit code is 1 where they differ).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
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
    from hybridflow.trainer import build, read_metrics
    from hybridflow.trainer.trainer import RLTrainer

    spec = build._run
    build._run = lambda cfg: dataclasses.replace(spec(cfg), rows_in_object_store=rows_in_store)
    try:
        cfg = load_config(ROOT / config, [f"trainer.output_dir={out}", f"trainer.total_steps={steps}", *LAYOUTS[layout],
                                          *overrides])
        if not Path(cfg.model.path).is_absolute():
            cfg.model.path = str(ROOT / cfg.model.path)
            cfg.data.train_files = [str(ROOT / f) for f in cfg.data.train_files]
        trainer = RLTrainer(cfg)
        try:
            summary = trainer.fit()
        finally:
            trainer.shutdown()
    finally:
        build._run = spec
    return [r for r in read_metrics(summary["run_dir"] / "metrics.jsonl") if r["step"] >= 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--config", default="configs/tiny-grpo.yaml")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="apart")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory(prefix="bench-data-plane-") as tmp:
        runs = {name: run(args.config, args.steps, store, args.overrides, Path(tmp) / name, args.layout)
                for name, store in (("via driver", False), ("object store", True))}
    before, after = runs["via driver"], runs["object store"]
    differ = [a["step"] for a, b in zip(before, after) if learned(a) != learned(b)]
    if differ:
        print(f"steps {differ}: the two runs' learned metrics differ")
    where = {"apart": "actor DP2 + rollout apart at tg=2 (4 Ray CPU processes)",
             "colocated": "actor and rollout at DP2 (2 Ray CPU processes)"}[args.layout]
    print(f"{args.config}, {where}, {args.steps} steps; KiB per step")
    print(f"{'step':>4} {'rows via':<13} {'shipped':>9} {'received':>9} {'driver':>9} {'vs before':>9} "
          f"{'sync KiB/rank':>13} {'formula':>8} {'sync s':>7}")
    for a, b in zip(before, after):
        for name, r in (("driver", a), ("object store", b)):
            kib = {k: r.get(k, 0.0) / 1024 for k in KEYS if "bytes" in k}
            ratio = r["controller/driver_bytes"] / a["controller/driver_bytes"]
            print(f"{r['step']:>4} {name:<13} {kib['controller/shipped_bytes']:9.1f} "
                  f"{kib['controller/received_bytes']:9.1f} {kib['controller/driver_bytes']:9.1f} {ratio:8.2f}x "
                  f"{kib['sync/bytes_received']:13.1f} {kib['sync/formula_bytes_received']:8.1f} "
                  f"{r.get('sync/time_s', 0.0):7.3f}")
    return 1 if differ else 0


def learned(record: dict) -> dict:
    """A step's learned metrics (rewards, the actor's and critic's figures, lengths)."""
    return {k: v for k, v in record.items() if k.startswith(("reward/", "actor/", "critic/", "response/"))}


if __name__ == "__main__":
    sys.exit(main())
