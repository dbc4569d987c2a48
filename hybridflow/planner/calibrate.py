"""Calibration: fit a device's efficiency factors to stage times measured by `hybridflow bench e2e --json`.

The benchmark writes, per algorithm, the median seconds of each stage of a step (rollout, log_probs,
values, update, transition, ...) and the step's real token counts (`tokens`, `answer_tokens`). Its JSON
does not record the config it ran, so the caller passes the same config and overrides the benchmark
used (for `ppo`, the demo with bench_e2e's PPO overrides). Fitting, in order:

0. where a run of one process beside the node's busy run is given (`bench calibrate`'s third run), the
   device's `compute_share`: how much slower each process computes while the node's others do too;
1. GEMM efficiency from the update (the training passes are almost all matrix products);
2. decode efficiency and the per-layer launch overhead, scaled together, from the rollout (a step of a
   small model is launch-bound, of a large one bandwidth-bound: one factor moves both);
3. the rollout and the forward passes (log_probs, values) keep a residual factor each, the ratio of
   measured to predicted after 1-2: their kernels differ from the update's (the C++ decode loop, fused
   log-probs, a value head), and a FLOP-bound decode step of a small model does not move with 2.

`predict` then gives every stage's seconds for any config on the calibrated device; a test checks the
prediction against a second measurement at another batch size.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from hybridflow.errors import ConfigError
from hybridflow.planner.devices import DeviceSpec
from hybridflow.planner.search import Candidate, Planner

BENCH_STAGES = ("rollout", "log_probs", "values", "update", "transition")


@dataclass(frozen=True)
class Calibrated:
    device: DeviceSpec
    residual: dict[str, float]  # bench stage -> measured / predicted after the device fit

    def scale(self, stages: dict[str, float]) -> dict[str, float]:
        return {k: v * self.residual.get(k, 1.0) for k, v in stages.items()}


def read_bench(path: str | Path, algo: str) -> dict[str, float]:
    """One algorithm's figures from a `bench e2e --json` file; errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file not found: {path}")
    try:
        results = json.loads(path.read_text())["results"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError("--calibrate", f"{path} is not the JSON of `hybridflow bench e2e --json` "
                          "(no 'results' mapping)") from None
    if algo not in results:
        raise ConfigError("--calibrate-algo", f"{path} holds {sorted(results)}, not {algo!r}")
    figures = results[algo]
    missing = [k for k in (*BENCH_STAGES, "tokens", "answer_tokens") if k not in figures]
    if missing:
        raise ConfigError("--calibrate", f"{path}: results.{algo} lacks {missing}")
    return figures


def bench_stages(c: Candidate) -> dict[str, float]:
    """A candidate's seconds per stage, named as `bench e2e` names them."""
    sec = {name: sum(parts.values()) for name, parts in c.stages.items()}
    return {"rollout": sec.get("rollout", 0.0),
            "log_probs": sec.get("reference", 0.0) + sec.get("old_log_probs", 0.0),
            "values": sec.get("values", 0.0) + sec.get("reward_model", 0.0),
            "update": sec.get("actor_update", 0.0) + sec.get("critic_update", 0.0),
            "transition": sec.get("transition", 0.0)}


def fit(evaluate, device: DeviceSpec, measured: dict[str, float], rounds: int = 3, single=None) -> Calibrated:
    """Fit `device` so that `evaluate(device) -> Candidate` reproduces the measured update and rollout.

    `evaluate` is the run's own layout costed on a device (see `measured_candidate`). `single`: optionally
    (evaluate_one, figures_one), a run of one process, whose update against the run's gives the device's
    `compute_share` (`fit_share`) before the efficiencies are fitted."""
    if single is not None:
        device = fit_share(evaluate, measured, *single, device)
    for _ in range(rounds):  # the two fits share the launch overhead: a few rounds settle them
        compute, rest = _update_parts(evaluate(device))
        if measured["update"] > rest and compute > 0:
            gemm = device.efficiency["gemm"] * compute / (measured["update"] - rest)
            ratio = gemm / device.efficiency["gemm"]
            device = device.with_efficiency(gemm=min(1.0, gemm),
                                            attention=min(1.0, device.efficiency["attention"] * ratio))
        device = _fit_rollout(evaluate, device, measured["rollout"])
    predicted = bench_stages(evaluate(device))
    residual = {k: measured[k] / predicted[k] for k in ("rollout", "log_probs", "values")
                if predicted[k] > 0 and measured[k] > 0}
    return Calibrated(device=device, residual=residual)


def _update_parts(c: Candidate) -> tuple[float, float]:
    """(compute, the rest) of a candidate's update seconds."""
    update = c.stages["actor_update"], c.stages.get("critic_update", {})
    compute = sum(p.get("compute", 0.0) for p in update)
    return compute, sum(sum(p.values()) for p in update) - compute


def fit_share(evaluate, measured: dict[str, float], evaluate_one, one: dict[str, float],
              device: DeviceSpec) -> DeviceSpec:
    """`device` with the `compute_share` that makes the update's compute of a run whose node is busy (`evaluate`,
    `measured`) and of a run of one process (`evaluate_one`, `one`) scale alike: each run's measured compute over
    its predicted at share 1, the busy run's over the lone one's (the efficiency cancels)."""
    device = device.with_efficiency(compute_share=1.0)
    busy, alone = _update_parts(evaluate(device)), _update_parts(evaluate_one(device))
    if min(busy[0], alone[0]) <= 0 or measured["update"] <= busy[1] or one["update"] <= alone[1]:
        return device
    share = ((one["update"] - alone[1]) / alone[0]) / ((measured["update"] - busy[1]) / busy[0])
    return device.with_efficiency(compute_share=min(1.0, max(0.05, share)))


def _fit_rollout(evaluate, device: DeviceSpec, seconds: float, rounds: int = 8) -> DeviceSpec:
    """Scale the decode efficiency down and the launch overhead up by one factor until the rollout takes
    `seconds` (a capped efficiency or a FLOP-bound step leaves part of the time unmoved: hence rounds)."""
    for _ in range(rounds):
        rollout = evaluate(device).stages["rollout"]
        total = sum(rollout.values())
        if total <= 0 or abs(total / seconds - 1) < 1e-3:
            break
        g = seconds / total
        device = device.with_efficiency(decode=min(1.0, device.efficiency["decode"] / g),
                                        layer_overhead=device.layer_overhead * g)
    return device


def measured_lengths(figures: dict[str, float], rows: int) -> tuple[float, float]:
    """(mean prompt, mean response) tokens of the measured step: `tokens` counts prompt and response."""
    response = float(figures["answer_tokens"])
    return max(1.0, figures["tokens"] / rows - response), max(1.0, response)


def measured_candidate(planner: Planner, n: int, actor, critic, tg: int) -> Candidate:
    """The run as configured (not searched): colocated on `n` devices at the config's layouts."""
    return planner.colocated(n, actor, critic, tg)


def errors(predicted: dict[str, float], measured: dict[str, float], floor: float = 0.01) -> dict[str, float]:
    """Relative error per stage that took at least `floor` seconds."""
    return {k: predicted[k] / measured[k] - 1 for k in BENCH_STAGES if measured.get(k, 0.0) >= floor}


def replace_workload(planner: Planner, **changes) -> Planner:
    return Planner(planner.model, dataclasses.replace(planner.wl, **changes), planner.device)
