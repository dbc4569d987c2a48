"""Off-policy overlap: the same GRPO work on 2 processes under sync, one_step and async, beside colocated DP2.

    hybridflow bench async [--steps N] [--warmup W] [--prompts P] [--max-response R] [--temperature T]
                           [--val N] [--only NAMES] [--calibration PATH] [--json PATH]

Five runs of the demo task (configs/demo.yaml's model, data, batch of 128
prompts x 4 and GRPO), each on two Ray processes:

    split sync                training on process 0, the rollout group apart on 1, lock step
    split one_step            the same, batch t + 1 generating while update t runs, decoupled PPO
                              (actor.off_policy_correction=decoupled: the sampler's log-probs weigh
                              each token against the proximal policy)
    split async k=2           the same, the rollout up to 2 versions ahead, decoupled PPO
    split async k=2 uncorr.   the same without a correction (the loss as if the samples were fresh)
    colocated DP2 sync        both processes train (DP2) and generate (the hybrid layout; the default)

The workload is long-tailed: sampling at `--temperature` with room for
`--max-response` tokens (the model's 64 positions less the 16-token prompt),
most responses end after the answer (~5 tokens) and a few run on, so a batch
waits for its longest row. The default 40 steps (20,480 samples) put every
run past the demo's steepest early climb, where one step of lag shows most in
the accuracy. Beside the runs, the overlap's bound for this workload: split
sync's step over its slower side (max(rollout, training)), what a perfect
overlap on idle cores could reach. Per run, over
the N timed steps after W warm-up ones: samples (responses) per second, each
group's busy fraction (rollout: its seconds generating / the steps' wall
time; training: old log-probs + update / wall time; colocated, both share the
same processes), the mean staleness, the response lengths, and the greedy
held-out accuracy on the first `--val` test prompts after the same number of
samples (W + N steps each). Speed-ups are ratios to split sync measured in
this one run. The machine is shared: read the ratios, not the seconds.

Beside each run's measured seconds per step (wall / steps), two predictions
of it and their errors (predicted / measured - 1):

    model s   the planner's cost model (`hybridflow/planner/overlap.py` over the
              split-all candidate's stages, the colocated candidate's sum),
              calibrated as `bench calibrate` calibrates it, on the demo's PPO
              step measured in this run before and after the timed ones (2
              processes at the full and half batch, one of them alone at the
              half: the efficiencies and how much slower each process computes
              while both do), or on
              a `bench calibrate --record` file (`--calibration`); the model is
              given the lengths the run measured (the rollout decodes to each
              step's longest response, the training passes see the mean), which
              it cannot know itself;
    stages s  the same overlap model over this run's own per-stage medians
              (rollout less its weight sync, sync, reward + log-probs, update):
              the error of the overlap's composition alone.
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
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_calibrate (hybridflow bench runs this by path)

SPLIT = ["placement.training=[0]", "placement.reference=[0]", "placement.critic=[0]", "placement.rollout=[1]"]
DECOUPLED = ["actor.off_policy_correction=decoupled"]
ASYNC2 = ["trainer.off_policy=async", "trainer.max_staleness=2"]
RUNS = {
    "split sync": SPLIT,
    "split one_step": SPLIT + ["trainer.off_policy=one_step"] + DECOUPLED,
    "split async k=2": SPLIT + ASYNC2 + DECOUPLED,
    "split async k=2 uncorr.": SPLIT + ASYNC2,
    "colocated DP2 sync": [],
}


def run_config(name: str, overrides: list[str], args, out: Path):
    """The run's config: the demo under the bench's settings and the run's overrides."""
    from hybridflow.config.loader import load_config

    steps = args.warmup + args.steps
    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        f"trainer.output_dir={out}", f"trainer.experiment={name.replace(' ', '_').replace('=', '')}",
        "trainer.n_devices=2", "trainer.launcher=ray", f"trainer.total_steps={steps}", "trainer.val_every=0",
        "trainer.val_before_train=false", "trainer.save_every=0", "trainer.overwrite=true", "trainer.loggers=[jsonl]",
        "trainer.plot=false",  # the run directory is a temporary one: a plot would be drawn to be deleted
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
        f"data.max_response_length={args.max_response}", f"rollout.temperature={args.temperature}",
        f"data.val_max_samples={args.val}", "data.val_batch_size=200", "algorithm.skip_uniform_groups=false",
        *overrides])
    for section in (cfg.data,):  # the demo's paths are relative to the repository
        section.train_files = [str(ROOT / f) for f in section.train_files]
        section.val_files = [str(ROOT / f) for f in section.val_files]
    cfg.model.path = str(ROOT / cfg.model.path)
    return cfg


def measure(name: str, overrides: list[str], args, out: Path) -> dict:
    from hybridflow.trainer import read_metrics
    from hybridflow.trainer.trainer import RLTrainer

    cfg = run_config(name, overrides, args, out)
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
            # the step's decode runs to its longest row: the rollout's length; the training passes see the mean
            "length_max_median": statistics.median(r["response/length_max"] for r in records),
            "prompt_len": statistics.mean(r["batch/tokens"] for r in records) / (args.prompts * cfg.rollout.n)
            - statistics.mean(r["response/length_mean"] for r in records),
            "mean_step_s": wall / len(records),
            "sync_s": statistics.median([r["sync/time_s"] for r in records if "sync/time_s" in r] or [0.0]),
            "accuracy": summary["end"].get("val/accuracy", float("nan")), "samples": rows,
            # the sampler-trainer gap, and the tensor bytes the driver received from the groups per step
            "k3_kl": statistics.mean(r.get("offpolicy/k3_kl", float("nan")) for r in records),
            "driver_received_bytes": statistics.mean(r.get("controller/received_bytes", 0.0) for r in records),
            "stages_s": {k.removeprefix("timing/"): statistics.median(r.get(k, 0.0) for r in records)
                         for k in sorted({k for r in records for k in r if k.startswith("timing/")})}}


CALIBRATION_STEPS = 4  # timed steps of each of the calibration's PPO runs


def calibration_round(reverse: bool = False) -> dict[str, dict]:
    """One round of `bench calibrate`'s runs (the demo's PPO step on 2 processes at the full and half batch, and
    at the half on one of the two alone), in its order or reversed."""
    import bench_calibrate

    runs = tuple(bench_calibrate.RUNS)
    return bench_calibrate.measure_abba(1, runs[::-1] if reverse else runs, CALIBRATION_STEPS)


def mean_rounds(*rounds: dict[str, dict]) -> dict[str, dict]:
    """Each run's figures averaged over the rounds."""
    return {name: {k: sum(r[name][k] for r in rounds) / len(rounds) for k in rounds[0][name]} for name in rounds[0]}


def fitted_from(figures: dict[str, dict]):
    """The CPU spec fitted to the calibration's figures as `bench calibrate` fits it."""
    import bench_calibrate

    return bench_calibrate.fitted_device(figures)


def recorded_calibration(path: Path) -> dict[str, dict]:
    """The figures of a `bench calibrate --record` file."""
    import bench_calibrate

    return {k: v for k, v in json.loads(Path(path).read_text()).items() if k in bench_calibrate.RUNS}


def mode_of(cfg) -> tuple[str, int, int]:
    t = cfg.trainer
    return t.off_policy, t.max_staleness, t.sync_every


def predict_model(cfg, r: dict, fitted) -> float:
    """Seconds per step of the run as the planner's calibrated cost model predicts them (`overlap.py` over
    the split-all candidate's stages; the colocated candidate's sum of stages), at the lengths the run
    measured: the rollout decodes to each step's longest response (the median of the steps' maxima), the
    training passes see the mean. The rollout and forward passes keep the calibration's residual factors."""
    import dataclasses

    from hybridflow.parallel.layout import ParallelDims
    from hybridflow.planner import calibrate, overlap
    from hybridflow.planner.cli import resolve_model
    from hybridflow.planner.roles import Workload
    from hybridflow.planner.search import Planner

    model = resolve_model(cfg.model.path, "model.path")
    train = Workload.from_config(cfg, r["prompt_len"], r["length_mean"])
    roll = dataclasses.replace(train, response_len=float(r["length_max_median"]))
    rollout_f, forward_f = fitted.residual.get("rollout", 1.0), fitted.residual.get("log_probs", 1.0)
    if not cfg.placement.rollout:  # colocated DP2: today's model, the stages one after another
        layout = ParallelDims(tp=1, pp=1, dp=2)
        c = Planner(model, train, fitted.device).colocated(2, layout, None, 1)
        st = calibrate.bench_stages(c)
        rollout = calibrate.bench_stages(Planner(model, roll, fitted.device).colocated(2, layout, None, 1))["rollout"]
        return rollout * rollout_f + st["transition"] + st["log_probs"] * forward_f + st["update"]
    one = ParallelDims(tp=1, pp=1, dp=1)
    devices = {"rollout": 1, "actor": 1}
    c = Planner(model, train, fitted.device).split("split-all", devices, one, None, 1)
    rollout = sum(Planner(model, roll, fitted.device).split("split-all", devices, one, None, 1)
                  .stages["rollout"].values())
    st = dataclasses.replace(c.split_stages, rollout=rollout * rollout_f, prep=c.split_stages.prep * forward_f)
    mode, k, e = mode_of(cfg)
    return overlap.iteration_seconds(mode, st, k, e)


def predict_stages(cfg, r: dict) -> float:
    """Seconds per step composed by `overlap.py` from this run's own per-stage medians (what the model of the
    overlap alone predicts, the stage costs known): the rollout without its weight sync (a sync's wall time is
    measured apart), the reward and log-prob passes, the update (with the transition and the staged copy)."""
    from hybridflow.planner import overlap

    t = r["stages_s"]
    prep = t.get("reward_s", 0.0) + t.get("log_probs_s", 0.0)
    if not cfg.placement.rollout:  # colocated: the stages one after another
        return t.get("rollout_s", 0.0) + prep + t["update_s"]
    sync = r["sync_s"]
    st = overlap.SplitStages(rollout=max(0.0, t["rollout_s"] - sync), sync=sync, prep=prep, update=t["update_s"])
    mode, k, e = mode_of(cfg)
    return overlap.iteration_seconds(mode, st, k, e)


RECORDED_KEYS = ("mean_step_s", "step_s", "length_mean", "length_max_median", "prompt_len", "sync_s", "stages_s",
                 "predicted_model_s", "predicted_stages_s")


def record(path: Path, args, calibrated: dict, results: dict) -> None:
    """The calibration's figures and each run's measured ones (what `predict_model` reads), with the load."""
    import subprocess
    import time

    from figures import write_json

    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    write_json(path, {"how": "hybridflow bench async --record", "commit": rev, "date": time.strftime("%Y-%m-%d %H:%M"),
                      "load": os.getloadavg()[0], "cpu_count": os.cpu_count(),
                      "args": {k: getattr(args, k) for k in ("steps", "warmup", "prompts", "max_response",
                                                             "temperature", "val")},
                      "calibration": calibrated,
                      "results": {name: {k: r[k] for k in RECORDED_KEYS} for name, r in results.items()}})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=38)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--max-response", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.5)
    p.add_argument("--val", type=int, default=1000)
    p.add_argument("--only", default="", help="comma-separated run names (default: all five)")
    p.add_argument("--json", type=Path)
    p.add_argument("--record", type=Path, help="write the calibration and each run's measured figures in the form "
                   "tests/planner/test_split_prediction.py reads (tests/planner/data/async_cpu_2proc.json)")
    p.add_argument("--calibration", type=Path, default=None,
                   help="a `hybridflow bench calibrate --record` file the cost model is fitted to (default: "
                        "measure the calibration's runs in this run, before the timed ones, on this machine)")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from hybridflow.controller import init_ray

    init_ray(num_cpus=8)
    names = [n for n in RUNS if not args.only or n in args.only.split(",")]
    results = {}
    # the calibration's runs before the timed ones and again after them (reversed), so that the load's drift
    # over the bench falls on both alike
    before = calibration_round() if args.calibration is None else None
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = measure(name, RUNS[name], args, Path(tmp))
        calibrated = (mean_rounds(before, calibration_round(reverse=True)) if args.calibration is None
                      else recorded_calibration(args.calibration))
        fitted = fitted_from(calibrated)
        for name, r in results.items():
            cfg = run_config(name, RUNS[name], args, Path(tmp))
            r["predicted_model_s"], r["predicted_stages_s"] = predict_model(cfg, r, fitted), predict_stages(cfg, r)
            r["error_model"] = r["predicted_model_s"] / r["step_s"] - 1
            r["error_model_mean"] = r["predicted_model_s"] / r["mean_step_s"] - 1
            r["error_stages"] = r["predicted_stages_s"] / r["mean_step_s"] - 1
    base = results.get("split sync", {}).get("samples_per_s")
    print(f"{args.prompts} prompts x 4 samples per step, {args.steps} timed steps after {args.warmup}, "
          f"temperature {args.temperature}, up to {args.max_response} tokens; load average {os.getloadavg()[0]:.1f}")
    print(f"{'run':<20} {'samples/s':>9} {'vs sync':>7} {'rollout busy':>12} {'train busy':>10} "
          f"{'staleness':>9} {'len mean':>8} {'len max':>7} {'val acc':>7} {'s/step':>7} {'median':>7} "
          f"{'model s':>7} {'error':>6} {'stages s':>8} {'error':>6}")
    for name, r in results.items():
        ratio = r["samples_per_s"] / base if base else float("nan")
        print(f"{name:<20} {r['samples_per_s']:>9.1f} {ratio:>6.2f}x {r['rollout_busy']:>12.2f} "
              f"{r['training_busy']:>10.2f} {r['staleness']:>9.2f} {r['length_mean']:>8.1f} {r['length_max']:>7.0f} "
              f"{r['accuracy']:>7.3f} {r['mean_step_s']:>7.3f} {r['step_s']:>7.3f} {r['predicted_model_s']:>7.3f} "
              f"{r['error_model']:>+6.0%} {r['predicted_stages_s']:>8.3f} {r['error_stages']:>+6.0%}")
    sync = results.get("split sync")
    if sync is not None:  # what a perfect overlap of this workload's two sides could reach
        t = sync["stages_s"]
        training = t.get("reward_s", 0.0) + t.get("log_probs_s", 0.0) + t["update_s"]
        bound = t["step_s"] / max(t["rollout_s"], training)
        print(f"overlap bound: split sync's step {t['step_s']:.3f} s over max(rollout {t['rollout_s']:.3f} s, "
              f"reward + log-probs + update {training:.3f} s) = {bound:.2f}x")
        sync["overlap_bound"] = bound
    source = "in this run" if args.calibration is None else args.calibration.name
    print(f"calibration ({source}): {fitted.device.describe()}")
    print("s/step: measured (wall / steps); median: the median step; model s: the planner's cost model calibrated "
          f"on this machine ({source}, stage medians) at the measured lengths, its error against the median step "
          "(a load spike moves the mean; the error against the mean is in the JSON); stages s: the same overlap "
          "model over this run's own measured stage medians, against the mean; error = predicted / measured - 1")
    if args.json:
        given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": given,
                                         "calibration": calibrated, "results": results}, indent=1))
    if args.record:
        record(args.record, args, calibrated, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
