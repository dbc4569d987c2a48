"""Off-policy overlap: the same GRPO work on 2 processes under sync, one_step and async, beside colocated DP2.

    hybridflow bench async [--steps N] [--warmup W] [--prompts P] [--max-response R] [--temperature T]
                           [--val N] [--json PATH]

Five runs of the demo task (configs/demo.yaml's model, data and GRPO), each
on two Ray processes:

    split sync       training on process 0, the rollout group apart on 1, lock step
    split one_step   the same, batch t + 1 generating while update t runs
    split async k=2  the same, the rollout up to 2 versions ahead
    ... tis          the same, with truncated importance sampling (actor.off_policy_correction=tis)
    colocated DP2    both processes train (DP2) and generate (the hybrid layout; the default)

The workload is long-tailed: sampling at `--temperature` with room for
`--max-response` tokens, most responses end after the answer (~5 tokens) and a
few run on to the limit, so a batch waits for its longest row. Per run, over
the N timed steps after W warm-up ones: samples (responses) per second, each
group's busy fraction (rollout: its seconds generating / the steps' wall
time; training: old log-probs + update / wall time; colocated, both share the
same processes), the mean staleness, the response lengths, and the greedy
held-out accuracy on the first `--val` test prompts after the same number of
samples (W + N steps each). Speed-ups are ratios to split sync measured in
this one run. The machine is shared: read the ratios, not the seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLIT = ["placement.training=[0]", "placement.reference=[0]", "placement.critic=[0]", "placement.rollout=[1]"]
RUNS = {
    "split sync": SPLIT,
    "split one_step": SPLIT + ["trainer.off_policy=one_step"],
    "split async k=2": SPLIT + ["trainer.off_policy=async", "trainer.max_staleness=2"],
    "split async k=2 tis": SPLIT + ["trainer.off_policy=async", "trainer.max_staleness=2",
                                    "actor.off_policy_correction=tis"],
    "colocated DP2 sync": [],
}


def measure(name: str, overrides: list[str], args, out: Path) -> dict:
    from hybridflow.config.loader import load_config
    from hybridflow.trainer import read_metrics
    from hybridflow.trainer.trainer import RLTrainer

    steps = args.warmup + args.steps
    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        f"trainer.output_dir={out}", f"trainer.experiment={name.replace(' ', '_').replace('=', '')}",
        "trainer.n_devices=2", "trainer.launcher=ray", f"trainer.total_steps={steps}", "trainer.val_every=0",
        "trainer.val_before_train=false", "trainer.save_every=0", "trainer.loggers=[jsonl]",
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"data.max_response_length={args.max_response}", f"rollout.temperature={args.temperature}",
        f"data.val_max_samples={args.val}", "data.val_batch_size=200", "algorithm.skip_uniform_groups=false",
        *overrides])
    for section in (cfg.data,):  # the demo's paths are relative to the repository
        section.train_files = [str(ROOT / f) for f in section.train_files]
        section.val_files = [str(ROOT / f) for f in section.val_files]
    cfg.model.path = str(ROOT / cfg.model.path)
    trainer = RLTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.shutdown()
    records = [r for r in read_metrics(summary["run_dir"] / "metrics.jsonl") if r["step"] > args.warmup]
    wall = sum(r["timing/step_s"] for r in records)
    rows = args.prompts * cfg.rollout.n * len(records)
    train_s = sum(r.get("timing/log_probs_s", 0.0) + r["timing/update_s"] for r in records)
    return {"samples_per_s": rows / wall, "step_s": statistics.median(r["timing/step_s"] for r in records),
            "rollout_busy": sum(r["timing/rollout_busy_s"] for r in records) / wall, "training_busy": train_s / wall,
            "staleness": statistics.mean(r["offpolicy/staleness_mean"] for r in records),
            "length_mean": statistics.mean(r["response/length_mean"] for r in records),
            "length_max": max(r["response/length_max"] for r in records),
            "accuracy": summary["end"].get("val/accuracy", float("nan")), "samples": rows,
            "stages_s": {k.removeprefix("timing/"): statistics.median(r.get(k, 0.0) for r in records)
                         for k in sorted({k for r in records for k in r if k.startswith("timing/")})}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-response", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.5)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--only", default="", help="comma-separated run names (default: all five)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from hybridflow.controller import init_ray

    init_ray(num_cpus=8)
    names = [n for n in RUNS if not args.only or n in args.only.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = measure(name, RUNS[name], args, Path(tmp))
    base = results.get("split sync", {}).get("samples_per_s")
    print(f"{args.prompts} prompts x 4 samples per step, {args.steps} timed steps after {args.warmup}, "
          f"temperature {args.temperature}, up to {args.max_response} tokens; load average {os.getloadavg()[0]:.1f}")
    print(f"{'run':<20} {'samples/s':>9} {'vs sync':>7} {'rollout busy':>12} {'train busy':>10} "
          f"{'staleness':>9} {'len mean':>8} {'len max':>7} {'val acc':>7}")
    for name, r in results.items():
        ratio = r["samples_per_s"] / base if base else float("nan")
        print(f"{name:<20} {r['samples_per_s']:>9.1f} {ratio:>6.2f}x {r['rollout_busy']:>12.2f} "
              f"{r['training_busy']:>10.2f} {r['staleness']:>9.2f} {r['length_mean']:>8.1f} {r['length_max']:>7.0f} "
              f"{r['accuracy']:>7.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
