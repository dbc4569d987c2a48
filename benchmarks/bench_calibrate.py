"""The planner's cost model against measurement on this machine (issue 33, item 4).

    hybridflow bench calibrate [--rounds 2] [--json PATH] [--record PATH]

Runs the demo's PPO step (`bench e2e`'s settings) on 2 processes at the full
batch and at half of it, and at the half batch (each process's rows of the full
run) with every role on the first process (one thread, as each process of the
2-process runs has, the other core idle), taking turns A-B-C, C-B-A, ... so that a load that
drifts on a shared machine falls on all alike. It fits the CPU device's
efficiency factors to the full-batch run (what `hybridflow plan --calibrate`
does) and its `compute_share` to the one-process run against it (how much
slower each process computes while both do), predicts the half-batch run's
stage times from the fitted device, and prints measured, predicted and the
relative error per stage.

`--record PATH` writes both runs' measured figures, with the machine's load,
in the form `tests/planner/test_calibrate.py` reads
(`tests/planner/data/calibration_cpu_2proc.json`): the test checks the fit
against figures measured here without timing anything itself, and this
script is how they are measured again.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ (hybridflow bench runs this by path)
import bench_e2e  # noqa: E402
from figures import take_turns, write_json  # noqa: E402

TWO_PROCESSES = ["trainer.n_devices=2"]
HALF_BATCH = ["data.train_batch_size=64", "actor.ppo_mini_batch_size=64"]
# Every role on the first of the two processes: one process computes, on its one thread, the other core idle.
ON_ONE = [f"placement.{role}=[0]" for role in ("training", "reference", "critic", "rollout", "reward")]
RUNS = {"full": TWO_PROCESSES, "half": TWO_PROCESSES + HALF_BATCH, "single": TWO_PROCESSES + HALF_BATCH + ON_ONE}
STAGES = ("rollout", "log_probs", "values", "update")


def planner_for(overrides: list[str], figures: dict):
    """The demo under bench e2e's PPO overrides, at the measured mean prompt and response lengths."""
    from hybridflow.planner import calibrate
    from hybridflow.planner.cli import _load, build_parser, resolve_model
    from hybridflow.planner.devices import get_device
    from hybridflow.planner.roles import Workload
    from hybridflow.planner.search import Planner

    args = build_parser().parse_args([str(bench_e2e.ROOT / "configs" / "demo.yaml"), *bench_e2e.ALGOS["ppo"],
                                      *overrides, "--gpus", "2"])
    _, cfg = _load(args)
    wl = Workload.from_config(cfg)
    model_path = cfg.model.path if Path(cfg.model.path).is_absolute() else str(bench_e2e.ROOT / cfg.model.path)
    planner = Planner(resolve_model(model_path, "model.path"), wl, get_device("cpu"))
    prompt, response = calibrate.measured_lengths(figures, wl.rows)
    return calibrate.replace_workload(planner, prompt_len=prompt, response_len=response)


def evaluate(planner, processes: int = 2):
    """The demo as run: colocated on `processes` processes, actor and critic at p1-t1-d`processes`."""
    from hybridflow.parallel.layout import ParallelDims
    from hybridflow.planner.search import Planner

    layout = ParallelDims(tp=1, pp=1, dp=processes)
    return lambda device: Planner(planner.model, planner.wl, device).colocated(processes, layout, layout, 1)


def fitted_device(measured: dict[str, dict]):
    """The CPU spec fitted to the full-batch run's figures, its compute share to the one-process run's where
    `measured` holds one (a recording made before that run existed holds none: share 1)."""
    from hybridflow.planner import calibrate
    from hybridflow.planner.devices import get_device

    full = measured["full"]
    single = None
    if "single" in measured:
        one = measured["single"]
        single = (evaluate(planner_for(RUNS["single"], one), 1), one)
    return calibrate.fit(evaluate(planner_for(TWO_PROCESSES, full)), get_device("cpu"), full, single=single)


def fit_and_predict(measured: dict[str, dict]):
    """(fitted, predicted stage seconds of the half-batch run, relative errors): the CPU spec fitted
    (`fitted_device`), then asked for the half-batch run."""
    from hybridflow.planner import calibrate

    half = measured["half"]
    fitted = fitted_device(measured)
    predicted = fitted.scale(calibrate.bench_stages(evaluate(planner_for(RUNS["half"], half))(fitted.device)))
    return fitted, predicted, calibrate.errors(predicted, half)


def measure_abba(rounds: int, runs: tuple[str, ...] = tuple(RUNS), steps: int = 2) -> dict[str, dict]:
    """Each run's stage medians over `steps` steps (bench e2e's `measure`), the runs taking turns in the order
    of `runs`, then reversed; means over rounds."""
    seen = take_turns({name: (lambda o=RUNS[name]: bench_e2e.measure("ppo", steps, 1, o)) for name in runs}, rounds)
    return {name: {k: sum(f[k] for f in figures) / len(figures) for k, v in figures[0].items()
                   if isinstance(v, (int, float))} for name, figures in seen.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="turns of each run (ABBA order), default 2")
    parser.add_argument("--json", type=Path, help="write measured, predicted and errors here")
    parser.add_argument("--record", type=Path, help="write the measured figures for tests/planner/test_calibrate.py")
    args = parser.parse_args(argv)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    measured = measure_abba(args.rounds)
    load_after = os.getloadavg()[0]
    fitted, predicted, errors = fit_and_predict(measured)
    print(f"fitted on the full batch (2 processes, PPO, demo model): {fitted.device.describe()}")
    print(f"half batch     {'measured s':>10s} {'predicted s':>12s} {'error':>7s}")
    for stage in STAGES:
        print(f"  {stage:12s} {measured['half'][stage]:10.4f} {predicted[stage]:12.4f} {errors[stage]:+7.1%}")
    print(f"load average {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} cores; "
          f"{args.rounds} round(s) in {time.perf_counter() - start:.0f} s")
    report = {"measured": measured, "predicted": predicted, "errors": errors,
              "load": [load_before, load_after], "cpu_count": os.cpu_count()}
    if args.json:
        write_json(args.json, report)
    if args.record:
        rev = subprocess.run(["git", "-C", str(bench_e2e.ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
        write_json(args.record, {"how": "hybridflow bench calibrate --record", "commit": rev,
                                 "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
                                 "load": [load_before, load_after], "cpu_count": os.cpu_count(),
                                 **measured})
    return 0


if __name__ == "__main__":
    sys.exit(main())
