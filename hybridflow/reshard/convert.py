"""One conversion, start to end: refuse what cannot be done, plan, write beside DST, rename, verify.

Nothing is written before every refusal has had its say (a TP that does not
divide the heads or KV heads, a PP larger than the layers or not dividing
them, an unknown architecture, a non-empty DST without `overwrite`). The
output goes into a hidden temporary directory beside DST
(`.NAME.reshard-tmp-PID`) that is renamed to DST only when complete, so a
Ctrl-C, a kill or a full disk leaves DST as it was (absent, or the old
checkpoint) and never a directory that looks finished. An error removes the
temporary directory; a kill leaves it, named as what it is.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from hybridflow.errors import ConfigError
from hybridflow.parallel.layout import ParallelDims
from hybridflow.reshard.sources import Source, hf_dtype, open_source
from hybridflow.reshard.targets import Plan, Sink, human, plan_hf, plan_hybridflow, write_hf, write_hybridflow
from hybridflow.common import write_dir_atomically

TARGETS = ("hf", "hybridflow", "dist")


@dataclass
class Request:
    """What the command line asked for."""

    src: Path
    dst: Path
    to: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    role: str = "actor"
    config: Optional[Path] = None
    divisible_by: int = 128
    max_shard_bytes: int = 5 * 2**30
    dtype: Optional[str] = None
    overwrite: bool = False
    dry_run: bool = False
    verify: bool = False
    verify_logits: bool = False
    progress: bool = True


@dataclass
class Result:
    plan: Plan
    written: int  # bytes
    seconds: float
    peak_rss: int  # bytes, the process's high-water mark
    verified: Optional[str] = None

    def summary(self, dst: Path) -> str:
        text = (f"reshard: wrote {len(self.plan.items)} tensors, {human(self.written)} to {dst} "
                f"({self.plan.target}) in {self.seconds:.1f} s, peak memory {self.peak_rss / 2**20:.0f} MiB")
        return text + (f"; {self.verified}" if self.verified else "")


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes: VmHWM, the high-water mark of its own memory
    since it started (getrusage's ru_maxrss would also count the parent's pages it was forked with)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def check_layout(source: Source, req: Request) -> None:
    """ConfigError naming the option for a layout the model cannot be split into."""
    from hybridflow.config.validate import check_model_split

    cfg = source.cfg
    if req.pp > cfg.num_layers:
        raise ConfigError("--pp", f"{req.pp} pipeline stages for the model's {cfg.num_layers} layers")
    try:
        check_model_split(ParallelDims(tp=req.tp, pp=req.pp, dp=req.dp), "reshard", num_heads=cfg.num_heads,
                          num_kv_heads=cfg.num_kv_heads, num_layers=cfg.num_layers,
                          ffn_size=cfg.intermediate_size)
    except ConfigError as exc:
        option = "--" + exc.path.rsplit(".", 1)[-1]
        raise ConfigError(option, str(exc).removeprefix(f"{exc.path}: ")) from None


def check_request(source: Source, req: Request) -> None:
    """Every refusal that does not need the weights, before anything is written."""
    if req.to not in TARGETS:
        raise ConfigError("--to", f"{req.to!r} is not one of {TARGETS}")
    if req.to != "hybridflow" and (req.pp != 1 or req.dp != 1):
        raise ConfigError("--pp" if req.pp != 1 else "--dp", f"{req.to} checkpoints hold whole tensors; "
                          "--pp and --dp apply to --to hybridflow only")
    if req.to == "hf" and req.tp != 1:
        raise ConfigError("--tp", "HF checkpoints hold whole tensors; --tp applies to --to hybridflow and dist")
    check_layout(source, req)
    if req.to == "dist" and source.value_head:
        raise ConfigError("--to", "a critic has no megatron-core GPTModel form; convert it to hf or hybridflow")
    if req.verify_logits and source.value_head:
        raise ConfigError("--verify-logits", "a critic has no logits; --verify compares its tensors")
    dst = req.dst
    if dst.resolve() == Path(source.path).resolve() or Path(source.path).resolve().is_relative_to(dst.resolve()):
        raise ConfigError("DST", f"{dst} is (or holds) the source checkpoint")
    if dst.exists() and not dst.is_dir():
        raise ConfigError("DST", f"{dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not req.overwrite:
        raise ConfigError("DST", f"{dst} exists and is not empty; pass --overwrite to replace it (the old one is "
                                 "removed only once the new one is complete)")


def build_plan(source: Source, req: Request, reader) -> Plan:
    dtype = hf_dtype(reader, "model.embed_tokens.weight") if req.dtype is None else _dtype(req.dtype)
    if req.to == "hf":
        return plan_hf(source.cfg, dtype, source.role, req.max_shard_bytes)
    if req.to == "hybridflow":
        return plan_hybridflow(source.cfg, dtype, source.role, req.tp, req.pp, req.dp, req.divisible_by)
    from hybridflow.reshard.dist import plan_dist

    return plan_dist(source.cfg, dtype, req.tp, req.divisible_by)


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ConfigError("--dtype", f"{name!r} is not one of {sorted(table)}")
    return table[name]


def run(req: Request, out: Callable[[str], None] = print) -> Optional[Result]:
    """The conversion `req` asks for; with `dry_run` only the plan is printed (returns None)."""
    source = open_source(req.src, req.role, req.config)
    if not req.dry_run:
        clear_dead_runs(req.dst.absolute())  # before the checks: a DST moved aside by a killed run is back
    check_request(source, req)
    with source.open() as reader:
        plan = build_plan(source, req, reader)
        out(f"reshard: {source.describe()} -> {req.to} {_target_layout(req)}: {req.dst}")
        if req.dry_run:
            for line in plan.lines():
                out(line)
            out(f"dry run: nothing written; peak memory {peak_rss() / 2**20:.0f} MiB")
            return None
        started = time.perf_counter()
        sink = Sink(progress_bar(plan.tensor_bytes) if req.progress else lambda done, name: None)
        write_dir_atomically(req.dst, lambda tmp: _execute(plan, source, req, reader, tmp, sink), "reshard")
        if req.progress:
            sys.stderr.write("\n")
    result = Result(plan, sink.done * (req.dp if req.to == "hybridflow" else 1), time.perf_counter() - started,
                    peak_rss())
    if req.verify or req.verify_logits:
        from hybridflow.reshard.verify import verify

        result.verified = verify(source, req, plan)
    return result


def _target_layout(req: Request) -> str:
    if req.to == "hf":
        return "(whole tensors)"
    return str(ParallelDims(tp=req.tp, pp=req.pp, dp=req.dp)) if req.to == "hybridflow" else f"(for tp={req.tp})"


def _execute(plan: Plan, source: Source, req: Request, reader, tmp: Path, sink: Sink) -> None:
    if plan.target == "hf":
        write_hf(plan, reader, tmp, sink)
    elif plan.target == "dist":
        from hybridflow.reshard.dist import write_dist

        write_dist(plan, reader, tmp, sink)
    else:
        _write_run_checkpoint(plan, source, tmp, sink, reader)


def _write_run_checkpoint(plan: Plan, source: Source, root: Path, sink: Sink, reader) -> None:
    """A checkpoint root a run resumes from (trainer.resume=auto, trainer.checkpoint_dir=DST): its step
    directory through `CheckpointManager` (manifest, `latest` marker), trainer.json beside the shards."""
    from hybridflow.checkpoint.manager import CheckpointManager
    from hybridflow.common import atomic_write_json

    state = _trainer_state(source, plan)

    def write(step_dir: Path) -> None:
        write_hybridflow(plan, reader, step_dir, sink)
        atomic_write_json(step_dir / "trainer.json", state)

    CheckpointManager(root, keep_last=0).save(int(state["step"]), write)


def _trainer_state(source: Source, plan: Plan) -> dict:
    """trainer.json for the output: the source run's (its step, KL coefficient, sampler) where there is one,
    with this role's layout and model table; from an HF model, step 0 (a run starts at its first step)."""
    from hybridflow.models.bridge import get_bridge

    state: dict = {"step": 0}
    if source.step_dir is not None and (source.step_dir / "trainer.json").is_file():
        state = json.loads((source.step_dir / "trainer.json").read_text())
    shapes = get_bridge(source.cfg, plan.divisible_by, 1).megatron_shapes()  # as the trainer records them
    if plan.role == "critic":
        shapes["output_layer.weight"] = (1, source.cfg.hidden_size)
    state["models"] = {plan.role: {k: list(v) for k, v in shapes.items()}}
    state["layouts"] = {plan.role: str(ParallelDims(tp=plan.tp, pp=plan.pp, dp=plan.dp))}
    return state


def clear_dead_runs(dst: Path) -> None:
    """Clean up after conversions into `dst` that were killed (their process is gone): a partial output
    `.NAME.reshard-tmp-PID` is removed; an old DST moved aside for `--overwrite` (`.NAME.reshard-old-PID`,
    killed between the two renames) is put back where DST is missing, else removed."""
    for entry in sorted(dst.parent.glob(f".{dst.name}.reshard-*-*")):
        kind, pid = entry.name.rsplit("-", 2)[-2:]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not dst.exists():
            os.replace(entry, dst)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def progress_bar(total: int, stream=None, width: int = 30) -> Callable[[int, str], None]:
    """A one-line bar on stderr, redrawn at most 10 times a second (and at the end)."""
    stream = stream or sys.stderr
    last = [0.0]

    def draw(done: int, name: str) -> None:
        now = time.perf_counter()
        if now - last[0] < 0.1 and done < total:
            return
        last[0] = now
        filled = int(width * done / max(total, 1))
        stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {human(done)} / {human(total)}  {name[-48:]:<48}")
        stream.flush()
    return draw
