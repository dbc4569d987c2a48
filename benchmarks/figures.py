"""What the benchmarks share: the peak resident memory of one measured call, and writing their figures.

`peak_extra_mib(fn)` runs `fn()` and returns its result and how far this
process's resident memory rose above what was resident just before the call
(MiB). Linux keeps a high-water mark of resident memory (VmHWM in
/proc/self/status) that writing "5" to /proc/self/clear_refs resets, so each
call gets a mark of its own and the candidate and the baseline can be
measured one after the other in one process. It counts every allocation
(torch's, a C++ extension's, HF's), which allocator hooks and the profiler's
per-op events do not; the price is page granularity, fine at the sizes
these benchmarks use. Memory the allocator kept from earlier frees is handed
back first (glibc `malloc_trim`), or a call reusing it would not show. Where
the mark cannot be reset (not Linux, a locked
down /proc) the figure is None and the tables print '-'.

`peak_rss_mib()` is the process's whole high-water mark (`ru_maxrss`), for a
benchmark that runs each side in a process of its own.

`write_json(path, figures)` writes a benchmark's `--json` file whole or not
at all (a temp file renamed into place), so a benchmark killed half-way
leaves no truncated file for `bench all` or a later comparison to read.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import sys
from typing import Any, Callable, Optional

_CLEAR_REFS = "/proc/self/clear_refs"


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _release_freed_memory() -> None:
    """Hand memory the allocator keeps after frees back to the OS (glibc's malloc_trim), so that a call
    which reuses it (the earlier timed runs freed exactly the buffers it needs) still raises the mark."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the mark may then under-count reused memory
        pass


def reset_peak() -> Optional[int]:
    """Start a new high-water mark; returns the resident bytes now, or None where that is not possible."""
    gc.collect()
    _release_freed_memory()
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return _status_bytes("VmRSS:")
    except OSError:
        return None


def peak_since(base: Optional[int]) -> Optional[float]:
    """MiB the high-water mark rose above `base` (from reset_peak), or None."""
    if base is None:
        return None
    return (_status_bytes("VmHWM:") - base) / 2**20


def peak_extra_mib(fn: Callable[[], Any]) -> tuple[Any, Optional[float]]:
    """(fn(), peak resident MiB during the call beyond what was resident before it)."""
    base = reset_peak()
    out = fn()
    return out, peak_since(base)


def peak_rss_mib() -> float:
    """This process's peak resident memory since it started (MiB; ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def mib(value: Optional[float], width: int = 9) -> str:
    """A MiB figure for a table column; '-' where it could not be measured."""
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}s}"


def ratio(new: Optional[float], base: Optional[float], width: int = 6) -> str:
    """new / base for a table column; '-' where either is missing or the base is ~0 (under a page)."""
    if new is None or base is None or base < 4 / 1024:
        return f"{'-':>{width}s}"
    return f"{new / base:{width}.3f}"


def write_json(path, figures: dict) -> None:
    """Write `figures` to `path` (str or Path) as JSON: a temp file beside it, then a rename."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(figures, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def take_turns(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list]:
    """Each run's results over `rounds` rounds, the runs taking turns A-B, B-A, ... so that a load that
    drifts on a shared machine falls on all alike."""
    names, seen = list(runs), {name: [] for name in runs}
    for r in range(max(1, rounds)):
        for name in (names if r % 2 == 0 else names[::-1]):
            seen[name].append(runs[name]())
    return seen


def peak_tensor_mib(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), the peak of the tensor bytes torch allocated during the call and still held, MiB), from the
    profiler's allocation events (self memory per op, so an allocation counts once). Counts tensors only:
    not a memory-mapped file's pages, not a library's own buffers (gloo's), which the resident mark does."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return out, peak / 2**20


def torchrun_json(script: str, nproc: int, argv: list[str], root) -> list:
    """Run `script` (a benchmark's rank part) on `nproc` gloo processes of one `torchrun` on this machine (CPU,
    one thread each) and return the JSON list rank 0 printed last; RuntimeError with the tail of stderr."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(port), script, *argv]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[")]
    if not lines:
        raise RuntimeError(f"{' '.join(cmd[-len(argv) - 1:])} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])

