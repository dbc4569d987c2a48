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

import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from hybridflow.common import SigintHandler, clear_dead_writes, write_dir_atomically
from hybridflow.errors import ConfigError
from hybridflow.parallel.layout import ParallelDims
from hybridflow.reshard import adapters
from hybridflow.reshard.base import Format, Plan, Sink, Source, hf_dtype, human
from hybridflow.reshard.formats import FORMATS, open_source
from hybridflow.reshard.fsdp import plan_foreign_hf, write_foreign_hf


@dataclass
class Request:
    """What the command line asked for."""

    src: Path
    dst: Path
    to: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_pp: int = 1
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
                          mlp_splits=tuple(cfg.mlp_splits), virtual_pp=req.virtual_pp if req.virtual_pp > 1 else None)
    except ConfigError as exc:
        option = "--" + exc.path.rsplit(".", 1)[-1]
        raise ConfigError(option, str(exc).removeprefix(f"{exc.path}: ")) from None


def check_experts(source: Source, req: Request) -> None:
    """--ep: an MoE model whose experts it divides, over --dp x --cp ranks it divides (megatron-core carves the
    expert-parallel groups from them, as the run's config check says)."""
    if req.ep == 1:
        return
    cfg = source.cfg
    if not cfg.is_moe:
        raise ConfigError("--ep", f"{req.ep}: the model has no experts (a dense {cfg.model_type})")
    if cfg.num_experts % req.ep:
        raise ConfigError("--ep", f"{req.ep} does not divide the model's {cfg.num_experts} experts")
    if (req.dp * req.cp) % req.ep:
        raise ConfigError("--ep", f"{req.ep} does not divide the --dp x --cp = {req.dp * req.cp} ranks the "
                                  "expert-parallel groups are made of")


def check_request(source: Source, req: Request) -> None:
    """Every refusal that does not need the weights, before anything is written."""
    if req.to not in FORMATS:
        raise ConfigError("--to", f"{req.to!r} is not one of {tuple(FORMATS)}")
    target = FORMATS[req.to]
    if not target.pp and (req.pp != 1 or req.dp != 1 or req.cp != 1 or req.ep != 1):
        option = next(f"--{k}" for k in ("pp", "dp", "cp", "ep") if getattr(req, k) != 1)
        raise ConfigError(option, f"{req.to} checkpoints hold whole tensors; --pp, --dp, --cp and --ep apply to "
                                  f"--to {_formats(' and ', lambda f: f.pp)} only")
    if req.virtual_pp != 1 and (req.to != "hybridflow" or req.pp < 2):
        raise ConfigError("--virtual-pp", "model chunks per pipeline stage (a run's actor.parallel.virtual_pp) "
                          f"apply to --to hybridflow with --pp >= 2; got --to {req.to} --pp {req.pp}")
    if not target.tp and req.tp != 1:
        raise ConfigError("--tp", f"{target.label} checkpoints hold whole tensors; --tp applies to --to "
                                  f"{_formats(' and ', lambda f: f.tp)}")
    check_layout(source, req)
    check_experts(source, req)
    if target.no_critic and source.value_head:
        raise ConfigError("--to", f"{target.no_critic}; convert it to {_formats(' or ', lambda f: not f.no_critic)}")
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


def _formats(joined: str, which: Callable[[Format], bool]) -> str:
    """The names of the formats `which` picks, for a refusal's "applies to" part."""
    return joined.join(name for name, f in FORMATS.items() if which(f))


def build_plan(source: Source, req: Request, reader) -> Plan:
    if not source.cfg.native:  # a model only transformers builds (an FSDP checkpoint of it): to HF as it is
        return plan_foreign_hf(source, req, None if req.dtype is None else _dtype(req.dtype), reader)
    dtype = hf_dtype(reader, "model.embed_tokens.weight") if req.dtype is None else _dtype(req.dtype)
    return FORMATS[req.to].plan(source, req, dtype)


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ConfigError("--dtype", f"{name!r} is not one of {sorted(table)}")
    return table[name]


def run(req: Request, out: Callable[[str], None] = print) -> Optional[Result]:
    """The conversion `req` asks for; with `dry_run` only the plan is printed (returns None). A LoRA
    checkpoint's adapters go their own way (`adapters.py`; returns None, its lines printed)."""
    source = open_source(req.src, req.role, req.config)
    if not req.dry_run:
        clear_dead_writes(req.dst, "reshard")  # before the checks: a DST moved aside by a killed run is back
    check_request(source, req)
    if source.kind == "hybridflow" and adapters.holds_adapters(source):
        started = time.perf_counter()
        written = adapters.convert(source, req, out)
        if not req.dry_run:
            out(f"reshard: wrote {human(written)} of adapters to {req.dst} in {time.perf_counter() - started:.1f} s")
        return None
    with source.open() as reader:
        plan = build_plan(source, req, reader)
        target = FORMATS[req.to]
        write_tensors = target.write if source.cfg.native else write_foreign_hf
        out(f"reshard: {source.describe()} -> {req.to} {target.layout(req)}: {req.dst}")
        if req.dry_run:
            for line in plan.lines():
                out(line)
            out(f"dry run: nothing written; peak memory {peak_rss() / 2**20:.0f} MiB")
            return None
        started = time.perf_counter()
        sink = Sink(progress_bar(plan.tensor_bytes) if req.progress else lambda done, name: None)

        def write(tmp: Path) -> None:
            with CtrlC() as ctrl_c:
                write_tensors(plan, source, reader, tmp, sink)
                ctrl_c.check()  # before the rename: a Ctrl-C a library swallowed still leaves no DST

        write_dir_atomically(req.dst, write, "reshard")
        if req.progress:
            sys.stderr.write("\n")
    result = Result(plan, sink.done * plan.copies, time.perf_counter() - started, peak_rss())  # copies: links
    if req.verify or req.verify_logits:
        from hybridflow.reshard.verify import verify

        result.verified = verify(source, req, plan)
    return result


class CtrlC(SigintHandler):
    """While open (in the main thread): a Ctrl-C raises KeyboardInterrupt as usual and is also remembered,
    so `check()` raises it again where code it interrupted swallowed it (an `except BaseException` in a
    library, an exception in a callback that Python only prints): the suite once saw an interrupted
    conversion finish and exit 0."""

    hit = False

    def _on_sigint(self, signum, frame) -> None:
        self.hit = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.hit:
            raise KeyboardInterrupt


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
