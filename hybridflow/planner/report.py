"""What `hybridflow plan` prints and writes: the ranked table, the best candidate's detail, the config
overlay and the throughput scenario.

The overlay is the run's config with the planner's choices written in (layouts, generation TP,
micro-batches, placement, device count): `hybridflow train OVERLAY.yaml` runs it as it is. It is written
atomically (a temporary file renamed into place) and loaded back through `load_config` before the
planner reports success, so a plan the config checks refuse is never left on disk.
"""
from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Optional

import yaml

from hybridflow.planner.devices import GIB
from hybridflow.planner.roles import Workload
from hybridflow.planner.search import Candidate

RESOURCES = {"compute": "compute (GEMM/attention)", "decode": "decode steps (memory bandwidth + launches)",
             "tp": "TP collectives", "pp": "pipeline sends", "dp": "DP gradient reduction", "link": "weight transfer",
             "overhead": "layer launch overhead", "dispatch": "MoE token dispatch (tp x ep group)",
             "experts": "expert-parallel gather of the experts"}


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def table(fits: list[Candidate], misfits: list[Candidate], wl: Workload, top: int) -> list[str]:
    """The ranked table (fitting candidates, fastest first) and the first candidates that do not fit."""
    names = next((list(c.modes) for c in fits if c.modes), [])
    modes = "/".join(n.replace("one_step", "1-step").replace("async ", "") for n in names)
    lines = [f"{'#':>3} {'placement and layouts':58s} {'iter s':>7s} {'prompts/day':>12s} "
             f"{'GiB/rank':>14s}  " + (f"{'s: ' + modes:>22s}  " if names else "") + "bottleneck"]
    for i, c in enumerate(fits[:top], 1):
        stage, resource, share = c.bottleneck()
        peaks = "/".join(_gib(v) for v in c.device_peak.values())
        per_mode = "/".join(_seconds(c.modes[n]) for n in names) if c.modes else "-"
        lines.append(f"{i:3d} {c.label():58s} {c.iteration_s:7.1f} {c.prompts_per_day(wl.prompts):12,.0f} "
                     f"{peaks:>14s}  " + (f"{per_mode:>22s}  " if names else "")
                     + f"{stage} {resource.split('.')[-1]} ({share:.0%})")
    if names:
        lines.append(f"    s: seconds per iteration of each trainer.off_policy mode where the rollout is apart "
                     f"({', '.join(names)}); 'iter s' is the run's own ({fits[0].mode if fits[0].modes else 'sync'})")
    lines.append(f"    {len(fits)} candidates fit, {len(misfits)} do not; the first that do not:")
    for c in sorted(misfits, key=_overshoot)[:top]:
        lines.append(f"    - {c.label()}: {c.reason}")
    return lines


def _seconds(s: float) -> str:
    return f"{s:.3g}" if s < 10 else f"{s:.0f}"


def modes(c: Candidate) -> list[str]:
    """A candidate with its rollout apart: each off-policy mode's iteration against lock step's, and the
    stages they are made of (overlap.py)."""
    if not c.modes:
        return []
    sync = c.modes["sync"]
    s = c.split_stages
    lines = [f"  off-policy modes with the rollout apart ({c.label()}; trainer.off_policy, a cost model's estimate):"]
    lines += [f"    {name:12s} {seconds:9.3f} s/iteration  {sync / seconds:5.2f}x lock step"
              + ("  <- the run's" if name == c.mode else "") for name, seconds in c.modes.items()]
    lines.append(f"    from: rollout {s.rollout:.3f}, sync {s.sync:.3f}, preparation {s.prep:.3f}, update "
                 f"{s.update:.3f}; off-policy adds the staged copy {s.stage:.4f} s")
    return lines


def _overshoot(c: Candidate) -> float:
    """How far a misfit is from fitting, for listing the nearest first."""
    try:
        return float(c.reason.split(" GiB over")[0].rsplit("(", 1)[-1].rsplit(": ", 1)[-1])
    except (ValueError, AttributeError):
        return float("inf")


def detail(c: Candidate, wl: Workload) -> list[str]:
    """Memory per rank per role and seconds per stage of one candidate."""
    lines = [f"best: {c.label()}; update micro-batches {c.micro}; decode batch {c.decode_batch} rows x "
             f"{c.waves} wave(s) per generation replica ({c.replicas} replicas)",
             "  memory per rank per role (GiB):"]
    for role, parts in c.memory.items():
        text = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())
        lines.append(f"    {role:13s} {_gib(sum(parts.values())):>6s}  ({text})")
    lines.append("  peak per device (GiB): " + ", ".join(f"{k} {_gib(v)}" for k, v in c.device_peak.items()))
    lines.append("  seconds per stage (critical path):")
    for stage, parts in c.stages.items():
        text = ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if v >= 0.005)
        lines.append(f"    {stage:13s} {sum(parts.values()):7.2f}  ({text})")
    by_resource: dict[str, float] = {}
    for parts in c.stages.values():
        for resource, seconds in parts.items():
            name = resource.split(".")[-1]
            by_resource[name] = by_resource.get(name, 0.0) + seconds
    total = sum(by_resource.values()) or 1.0
    lines.append("  time by resource: " + ", ".join(
        f"{RESOURCES.get(k, k)} {v / total:.0%}" for k, v in sorted(by_resource.items(), key=lambda kv: -kv[1])))
    stage, resource, share = c.bottleneck()
    kind = RESOURCES.get(resource.split(".")[-1], resource)
    lines.append(f"  iteration {c.iteration_s:.1f} s -> {c.prompts_per_day(wl.prompts):,.0f} prompts/day; "
                 f"bottleneck: {stage} {kind}, {share:.0%} of the iteration")
    return lines


def experts(c: Candidate, model, wl: Workload, others: list[Candidate]) -> list[str]:
    """An MoE model's expert parallelism: the ep picked and why (the best candidate at each ep searched, its
    iteration and memory per GPU, or the nearest that does not fit and why), the token dispatcher's bytes and
    the experts' switch bytes."""
    if not model.is_moe:
        return []
    from hybridflow.planner import cost

    lines = [f"expert parallelism: ep {c.ep} picked ({model.num_experts} experts, {model.num_experts // c.ep} per "
             f"rank), peak {'/'.join(_gib(v) for v in c.device_peak.values())} GiB per GPU; ep searched over the "
             f"divisors of dp x cp that divide the experts (config/validate_moe.py)"]
    best: dict[int, Candidate] = {}
    for o in sorted(others, key=lambda o: (not o.fits, o.iteration_s if o.fits else _overshoot(o))):
        best.setdefault(o.ep, o)
    for ep, o in sorted(best.items()):
        mem = o.memory.get("actor", {})
        states = _gib(sum(v for k, v in mem.items() if k != "activations")) + " GiB actor states/GPU" if mem else ""
        verdict = (f"{o.iteration_s:.1f} s/iteration, peak {'/'.join(_gib(v) for v in o.device_peak.values())} "
                   f"GiB/GPU" if o.fits else f"best does not fit: {o.reason}")
        lines.append(f"  ep {ep:3d}: {o.label()}: {states}; {verdict}" + ("  <- picked" if o is c else ""))
    if c.ep > 1:
        per = cost.dispatch_bytes_per_token(model, c.ep, wl.dtype_bytes)
        a2a = cost.alltoall_bytes_per_token(model, c.ep, wl.dtype_bytes)
        moved = cost.expert_transition_bytes(model, c.actor.tp, c.ep, wl.dtype_bytes, c.actor.pp)
        lines.append(f"  token dispatch (allgather dispatcher): {per / 1024:.1f} KiB per token per MoE layer forward "
                     f"(alltoall would move {a2a / 1024:.1f} KiB); experts gathered per switch "
                     f"{moved / GIB:.2f} GiB per rank, (ep - 1) / ep * X / tp")
    return lines


def overlay_data(c: Candidate, base: dict, uses_critic: bool, device: str) -> dict:
    """The base config's data with the candidate's choices written in."""
    data = copy.deepcopy(base)

    def section(key: str) -> dict:
        if not isinstance(data.get(key), dict):
            data[key] = {}
        return data[key]
    n = sum(c.devices.values())
    trainer = section("trainer")
    trainer["n_devices"] = n
    trainer["device"] = "cpu" if device == "cpu" else "cuda"
    actor = section("actor")
    actor["parallel"] = {**(actor.get("parallel") or {}), "tp": c.actor.tp, "pp": c.actor.pp, "cp": c.actor.cp,
                         "virtual_pp": c.virtual_pp if c.virtual_pp > 1 else None, "ep": c.ep}
    actor["ppo_micro_batch_size"] = c.micro.get("actor", actor.get("ppo_micro_batch_size", 8))
    if uses_critic and c.critic is not None:
        critic = section("critic")
        critic["parallel"] = {**(critic.get("parallel") or {}), "tp": c.critic.tp, "pp": c.critic.pp,
                              "cp": c.critic.cp, "ep": c.critic_ep}
        critic["ppo_micro_batch_size"] = c.micro.get("critic", critic.get("ppo_micro_batch_size", 8))
    section("rollout")["tg"] = c.tg
    data["placement"] = _placement(c)
    return data


def _placement(c: Candidate) -> dict:
    """Device indices per role: empty lists (every device) when colocated, else consecutive blocks."""
    if c.placement == "colocated":
        return {}
    start, blocks = 0, {}
    for group, count in c.devices.items():
        blocks[group] = list(range(start, start + count))
        start += count
    actor = blocks["actor"]
    side = blocks.get("critic", actor)
    return {"training": actor, "reference": actor, "rollout": blocks.get("rollout", actor), "critic": side,
            "reward": side}


def write_overlay(path: Path, data: dict, header: list[str]) -> None:
    """Write `data` as YAML under a comment header, atomically (temp file in the same directory, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(data, sort_keys=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def scenario(best: Optional[Candidate], wl: Workload, gpus: int, target: float,
             enough: Optional[Candidate]) -> list[str]:
    """Whether `target` prompts a day is reachable on `gpus` devices, and on how many if not."""
    lines = [f"scenario: {target:,.0f} prompts/day on {gpus} devices ({wl.prompts} prompts x {wl.n} sample(s) a "
             f"step, prompts {wl.prompt_len:.0f} and responses {wl.response_len:.0f} tokens)"]
    if best is None:
        lines.append("  no layout fits on this many devices")
    else:
        got = best.prompts_per_day(wl.prompts)
        verdict = "reachable" if got >= target else "NOT reachable"
        lines.append(f"  predicted {got:,.0f} prompts/day with {best.label()}: {verdict} "
                     f"({got / target:.2f}x the target)")
    if best is None or best.prompts_per_day(wl.prompts) < target:
        if enough is None:
            lines.append("  not reachable on any device count the search tried")
        else:
            n = sum(enough.devices.values())
            lines.append(f"  reachable with {n} devices: {enough.label()}, "
                         f"{enough.prompts_per_day(wl.prompts):,.0f} prompts/day")
    return lines
