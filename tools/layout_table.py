"""PPO at several training layouts against one process: the figures behind "layout-invariant updates".

    python tools/layout_table.py OUT.json        (from the repository root; PYTHONPATH=. for another tree)

configs/tiny-ppo.yaml, 3 steps of 2 epochs x 2 mini-batches, on 2 Ray processes: the actor at DP2 with the
critic at TP1 x DP2, and with the critic at TP2 x DP1. Prints and writes the critic and actor losses and
grad norms per step and each layout's largest relative difference from one process. Run on a worktree of an
older revision (cd there; PYTHONPATH=.) for the before column in docs/results.md.
"""
import json
import os
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "one process": [],
    "actor DP2, critic TP1xDP2": ["trainer.n_devices=2", "trainer.launcher=ray"],
    "actor DP2, critic TP2xDP1": ["trainer.n_devices=2", "trainer.launcher=ray", "critic.parallel.tp=2"],
}
KEYS = ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "actor/grad_norm")
STEPS = (1, 2, 3)


def run(overrides: list[str]) -> dict[int, dict]:
    """Metrics per step of tiny-ppo.yaml for three steps under `overrides`."""
    from hybridflow.config.loader import load_config
    from hybridflow.trainer import read_metrics
    from hybridflow.trainer.trainer import RLTrainer

    cfg = load_config("configs/tiny-ppo.yaml", [f"trainer.output_dir={tempfile.mkdtemp()}", "trainer.total_steps=3",
                                                 "trainer.save_every=0", "data.val_files=[]", *overrides])
    cfg.model.path = os.path.abspath(cfg.model.path)  # Ray workers start elsewhere
    cfg.data.train_files = [os.path.abspath(f) for f in cfg.data.train_files]
    trainer = RLTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.shutdown()
    return {r["step"]: r for r in read_metrics(summary["run_dir"] / "metrics.jsonl")}


def main(out: Path) -> None:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    runs = {name: run(overrides) for name, overrides in LAYOUTS.items()}
    one = runs["one process"]
    table = {}
    for name, metrics in runs.items():
        table[name] = {k: [metrics[s][k] for s in STEPS] for k in KEYS}
        table[name]["max_rel_diff"] = max(abs(metrics[s][k] - one[s][k]) / max(abs(one[s][k]), 1e-12)
                                          for s in STEPS for k in KEYS)
    out.write_text(json.dumps(table, indent=1))
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
