"""DAPO's dynamic sampling against GRPO per generated sample, on the demo task.

    hybridflow bench dapo [--prompts N] [--every E] [--val V] [--seeds S,...] [--runs NAMES] [--json PATH]

Runs, in one process each after the other, on configs/demo.yaml's model and data (128 prompts x 4 samples a
batch, GRPO):

    grpo      demo.yaml as shipped: the groups whose samples all scored the same are left out of the update
              (algorithm.skip_uniform_groups), the batch is not refilled
    dynamic   the same with dynamic sampling instead (algorithm.dynamic_sampling, up to 4 batches a step),
              and 4 optimizer steps a step (actor.ppo_mini_batch_size=32): early in the run about a quarter
              of the groups carry a signal, so grpo takes one optimizer step per ~30 such groups and this
              one per 32, the same number of optimizer steps per generated sample
    dapo      configs/dapo-demo.yaml: the whole recipe (clip-higher, token-mean, dynamic sampling, overlong
              shaping and filtering, the paper's std-normalised advantage)

Each run generates samples for N prompts (a step generates 128, or with refills 128 per batch), and after the
first step past every E generated prompts measures the greedy held-out accuracy on the first V test prompts.
The learning rate is constant in every run: a schedule over steps would decay at different sample counts in
runs that take different numbers of steps. A refilling run takes fewer updates for the same samples, each on
128 informative groups. The table gives each run's accuracy at equal generated prompts (the first
measurement at or past each multiple of E; the prompts actually generated beside it), its updates and its
seconds per 1000 generated prompts, which on this shared machine are for reading side by side only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {
    "grpo": ("demo.yaml", []),
    "dynamic": ("demo.yaml", ["algorithm.skip_uniform_groups=false", "algorithm.dynamic_sampling.enabled=true",
                              "algorithm.dynamic_sampling.max_batches=4", "actor.ppo_mini_batch_size=32"]),
    "dapo": ("dapo-demo.yaml", []),
}


def build(name: str, seed: int, val: int, out: Path):
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.trainer import RLTrainer

    config, overrides = RUNS[name]
    cfg = load_config(ROOT / "configs" / config, [
        *overrides, f"trainer.seed={seed}", f"data.val_max_samples={val}", "actor.optim.lr_schedule=constant",
        f"trainer.output_dir={out}", "trainer.loggers=[]", "trainer.plot=false", "trainer.total_steps=100000"])
    cfg.model.path = str(ROOT / cfg.model.path)
    cfg.data.train_files = [str(ROOT / f) for f in cfg.data.train_files]
    cfg.data.val_files = [str(ROOT / f) for f in cfg.data.val_files]
    return RLTrainer(cfg)


def run(name: str, seed: int, prompts: int, every: int, val: int) -> dict:
    """Train until `prompts` prompts' samples were generated; the accuracy after each `every`."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build(name, seed, val, Path(tmp))
        batch = trainer.cfg.data.train_batch_size
        try:
            points = [(0, trainer.validate()["val/accuracy"])]
            generated, step, seconds, kept = 0, 0, 0.0, []
            while generated < prompts:
                step += 1
                start = time.perf_counter()
                m = trainer.train_step(step)
                seconds += time.perf_counter() - start
                generated += int(m.get("dapo/generated_batches", 1)) * batch
                kept.append(m.get("dapo/kept_groups", m.get("batch/kept_fraction", 1.0) * batch))
                if generated // every > points[-1][0] // every:
                    points.append((generated, trainer.validate()["val/accuracy"]))
                    print(f"  {name} seed {seed}: {generated} prompts, {step} updates, "
                          f"accuracy {points[-1][1]:.3f}", flush=True)
        finally:
            trainer.shutdown()
    return {"points": points, "updates": step, "s_per_1k": 1000 * seconds / generated,
            "kept_groups": statistics.mean(kept)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=38400, help="prompts generated per run")
    ap.add_argument("--every", type=int, default=6400, help="measure the accuracy after each this many")
    ap.add_argument("--val", type=int, default=500, help="held-out prompts per measurement")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from hybridflow.engine.distributed import init_process_group

    init_process_group("cpu")
    names, seeds = args.runs.split(","), [int(s) for s in args.seeds.split(",")]
    results = {f"{n}/{s}": run(n, s, args.prompts, args.every, args.val) for s in seeds for n in names}
    print(f"\nheld-out greedy accuracy ({args.val} prompts) after N generated prompts (x4 samples); constant lr")
    print(f"{'N':>7} " + " ".join(f"{k:>16}" for k in results))
    for target in range(0, args.prompts + 1, args.every):
        cells = []
        for r in results.values():
            n, acc = next(((n, a) for n, a in r["points"] if n >= target), r["points"][-1])
            cells.append(f"{acc:7.3f} @{n:>7}")
        print(f"{target:>7} " + " ".join(f"{c:>16}" for c in cells))
    print(f"{'updates':>7} " + " ".join(f"{r['updates']:>16}" for r in results.values()))
    print(f"{'groups':>7} " + " ".join(f"{r['kept_groups']:>16.1f}" for r in results.values()))
    print(f"{'s/1k':>7} " + " ".join(f"{r['s_per_1k']:>16.2f}" for r in results.values()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
