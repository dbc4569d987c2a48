"""`hybridflow plan CONFIG.yaml [key=value ...] --gpus N --device NAME`: rank placements and parallel sizes.

Reads the run's config (batch shapes, algorithm, dtype) and the model's architecture (its config.json,
or `models.yaml` by the directory's name when no checkpoint is at hand), costs every candidate on the
device spec (`devices.yaml`, or one fitted by `--calibrate`), prints the ranked table, the best
candidate's memory per rank per role and stage times, a dry-run of its actor layout (meta-device model
and the real reshard plan beside the cost model's figures), and writes the best candidate as a config
that `hybridflow train` runs as it is (`--out`). Every figure is a model's estimate (docs/planner.md).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

import yaml

from hybridflow.errors import ConfigError
from hybridflow.models.config import DecoderConfig, ModelConfigError
from hybridflow.parallel.layout import ParallelDims
from hybridflow.planner import calibrate, report
from hybridflow.planner.devices import get_device
from hybridflow.planner.dryrun import dry_run
from hybridflow.planner.roles import Workload
from hybridflow.planner.search import PLACEMENTS, Planner, gpus_needed, rank

MODELS_FILE = Path(__file__).with_name("models.yaml")


def resolve_model(path: str, key: str, model_config: Optional[str] = None) -> DecoderConfig:
    """The architecture at `path` (its config.json), else the known one named like its directory."""
    try:
        if model_config is not None:
            return DecoderConfig.from_pretrained(model_config)
        if (Path(path) / "config.json").is_file():
            return DecoderConfig.from_pretrained(path)
        known = yaml.safe_load(MODELS_FILE.read_text())
        name = Path(path).name
        if name not in known:
            raise ConfigError(key, f"no config.json in {path!r} and {name!r} is not a known architecture "
                                   f"(known: {sorted(known)}); give --model-config PATH/config.json")
        return DecoderConfig.from_hf_dict(known[name])
    except ModelConfigError as exc:
        raise ConfigError(key, str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridflow plan", description=__doc__.split("\n")[0])
    p.add_argument("config", help="the run's YAML config")
    p.add_argument("overrides", nargs="*", default=[], help="dotted key=value overrides, as for train")
    p.add_argument("--gpus", type=int, required=True, help="devices in the job")
    p.add_argument("--device", default="a100", help="a device of devices.yaml: a100, h100, h200, cpu")
    p.add_argument("--devices-file", help="another device specs file (default: the packaged devices.yaml)")
    p.add_argument("--model-config", help="the model's config.json, when model.path holds none")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated subset of " +
                   ", ".join(PLACEMENTS))
    p.add_argument("--prompt-len", type=float, help="mean prompt tokens (default: data.max_prompt_length)")
    p.add_argument("--response-len", type=float, help="mean response tokens (default: data.max_response_length)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--out", type=Path, help="write the best candidate's config here")
    p.add_argument("--prompts-per-day", type=float, help="a throughput target: reachable, and on how many devices")
    p.add_argument("--calibrate", help="a `hybridflow bench e2e --json` file: fit the device's efficiencies to it "
                   "(CONFIG and overrides must be the run it measured)")
    p.add_argument("--calibrate-algo", default="ppo", help="which of the file's algorithms to fit (default ppo)")
    p.add_argument("--no-dry-run", action="store_true", help="skip the meta-device model and reshard plan")
    return p


def _load(args) -> tuple[dict, object]:
    """The config's raw data (for the overlay) and the typed config, checked only for types: the planner
    replaces the layouts and device count, so the file's own may not fit --gpus."""
    from hybridflow.config.loader import from_dict, load_config_data
    from hybridflow.config.schema import Config

    data = load_config_data(args.config, args.overrides)
    return data, from_dict(Config, data)


def _calibrated(args, planner: Planner, cfg) -> tuple[Planner, list[str]]:
    """The planner on a device fitted to the measured run, and lines saying what was fitted."""
    figures = calibrate.read_bench(args.calibrate, args.calibrate_algo)
    prompt, response = calibrate.measured_lengths(figures, planner.wl.rows)
    planner = calibrate.replace_workload(planner, prompt_len=prompt, response_len=response)
    n, a = cfg.trainer.n_devices, cfg.actor.parallel
    actor = ParallelDims.for_world(n, tp=a.tp, pp=a.pp, cp=a.cp)
    k = cfg.critic.parallel
    critic = ParallelDims.for_world(n, tp=k.tp, pp=k.pp, cp=k.cp) if planner.wl.uses_critic else None
    evaluate = lambda d: calibrate.measured_candidate(Planner(planner.model, planner.wl, d), n, actor, critic,
                                                      cfg.rollout.tg)
    fitted = calibrate.fit(evaluate, planner.device, figures)
    predicted = fitted.scale(calibrate.bench_stages(evaluate(fitted.device)))
    lines = [f"calibrated on {args.calibrate} ({args.calibrate_algo}, {n} process(es)): {fitted.device.describe()}",
             f"  residual factors (rollout and forward passes): {fitted.residual}",
             "  stage      measured s  predicted s"]
    lines += [f"  {k:10s} {figures[k]:10.4f} {predicted[k]:12.4f}" for k in calibrate.BENCH_STAGES]
    return Planner(planner.model, planner.wl, fitted.device), lines


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.gpus < 1:
        raise ConfigError("--gpus", f"must be >= 1, got {args.gpus}")
    placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    unknown = [p for p in placements if p not in PLACEMENTS]
    if unknown:
        raise ConfigError("--placements", f"unknown {unknown}; choose from {list(PLACEMENTS)}")
    start = time.perf_counter()
    data, cfg = _load(args)
    model = resolve_model(cfg.model.path, "model.path", args.model_config)
    reward = resolve_model(cfg.reward.model_path, "reward.model_path") if cfg.reward.model_path else None
    wl = Workload.from_config(cfg, args.prompt_len, args.response_len, reward)
    if wl.off_policy != "sync" and "split-all" not in placements:
        raise ConfigError("trainer.off_policy", f"{wl.off_policy!r} needs the rollout placed apart: only the "
                          f"split-all placement has it, and --placements is {','.join(placements)}")
    planner = Planner(model, wl, get_device(args.device, args.devices_file))
    if args.calibrate:
        planner, lines = _calibrated(args, planner, cfg)
        print("\n".join(lines))
    wl = planner.wl
    print(f"model {Path(cfg.model.path).name}: {model.num_layers} layers, hidden {model.hidden_size}, "
          f"{planner.model_bytes / wl.dtype_bytes / 1e9:.2f} B parameters ({cfg.model.dtype}); device "
          f"{planner.device.describe()}")
    print(f"workload: {wl.prompts} prompts x {wl.n} sample(s) a step, prompt {wl.prompt_len:.0f} + response "
          f"{wl.response_len:.0f} tokens (max {wl.max_len}); reference {wl.needs_reference}, critic "
          f"{wl.uses_critic}, reward model {reward is not None}")
    fits, misfits = rank(planner.candidates(args.gpus, placements))
    print(f"\n{len(fits) + len(misfits)} candidates on {args.gpus} x {args.device} (estimates of a cost model):")
    print("\n".join(report.table(fits, misfits, wl, args.top)))
    best = fits[0] if fits else None
    apart = next((c for c in fits if c.modes), None)  # the best candidate with its rollout apart
    if apart is not None:
        print("\n" + "\n".join(report.modes(apart)))
    if best is not None:
        print("\n" + "\n".join(report.detail(best, wl) + report.experts(best, model, wl, fits + misfits)))
        if not args.no_dry_run:
            print("\n" + "\n".join(dry_run(model, best.actor, best.tg, wl.dtype_bytes, wl.divisible_by, best.ep)
                                   .lines(wl.dtype_bytes)))
        if args.out:
            _write(args, data, best, wl, planner)
    if args.prompts_per_day:
        enough = None
        if best is None or best.prompts_per_day(wl.prompts) < args.prompts_per_day:
            enough = gpus_needed(planner, args.gpus + 1, args.prompts_per_day)
        print("\n" + "\n".join(report.scenario(best, wl, args.gpus, args.prompts_per_day, enough)))
    print(f"\nplanned in {time.perf_counter() - start:.1f} s")
    return 0 if best is not None else 1


def _write(args, data: dict, best, wl: Workload, planner: Planner) -> None:
    """The best candidate as a config, then loaded back through the config checks."""
    from hybridflow.config.loader import load_config

    header = [f"written by: hybridflow plan {args.config} --gpus {args.gpus} --device {args.device}",
              f"best candidate: {best.label()}",
              f"estimated iteration {best.iteration_s:.1f} s, {best.prompts_per_day(wl.prompts):,.0f} prompts/day "
              f"(a cost model's estimate, device {planner.device.key})"]
    overlay = report.overlay_data(best, data, wl.uses_critic, planner.device.key)
    report.write_overlay(args.out, overlay, header)
    load_config(args.out)
    print(f"\nwrote {args.out} (hybridflow train {args.out})")
