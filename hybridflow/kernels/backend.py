"""Backend selection for kernels, and the once-compiled C++ CPU extension.

Every kernel has a `reference` (plain PyTorch) and faster backends:

- `cpu`: the C++ extension in `csrc/cpu/`, JIT-compiled on first use with
  the machine's own flags (-O3 -march=native, OpenMP) and cached under
  `$HYBRIDFLOW_CACHE` (default `~/.cache/hybridflow`), so later processes
  load it in well under a second;
- `chunked`: plain PyTorch processed in chunks of tokens (memory-lean on any
  device) for kernels where that matters;
- `cuda`: the CUDA extension in `csrc/cuda/` (kernels in a torch-free .cu,
  a small binding .cpp), JIT-compiled and cached the same way, only where
  torch sees a CUDA device;
- `triton`: GPU kernels, only where a GPU toolchain exists;
- `auto`: the fastest one available for the input's device (C++ on CPU,
  CUDA on a GPU, else `chunked` when the kernel has it), else `reference`.

When an extension cannot be built, `auto` falls back to `chunked` (or the
reference) and says so once in the log; asking for that backend by name
raises instead.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from hybridflow.common import atomic_write

log = logging.getLogger("hybridflow.kernels")
BACKENDS = ("reference", "chunked", "cpu", "cuda", "triton", "auto")
CSRC = Path(__file__).resolve().parents[2] / "csrc"


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run here."""


def _cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDFLOW_CACHE", Path.home() / ".cache" / "hybridflow"))


def build_digest(sources: list[Path], headers: tuple[Path, ...], flags: dict) -> str:
    """What names a cached build: the sources' and headers' bytes, the compiler flags, torch's version."""
    key = b"".join(s.read_bytes() for s in (*sources, *headers)) + torch.__version__.encode()
    return hashlib.sha1(key + repr(sorted(flags.items())).encode()).hexdigest()[:12]


def _build(name: str, sources: list[Path], headers: tuple[Path, ...] = (), **flags) -> ModuleType:
    """JIT-compile `sources` once per content (with `headers`), flags and torch version, cached under `_cache_dir()`."""
    missing = [s for s in (*sources, *headers) if not s.is_file()]
    if missing:
        raise BackendUnavailable(f"source not found: {missing[0]}")
    from torch.utils import cpp_extension

    digest = build_digest(sources, headers, flags)
    build = _cache_dir() / f"{name}_{digest}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        with build_lock(build):
            staged = _stage_sources(build / "src", [*sources, *headers])[:len(sources)]
            return cpp_extension.load(name=f"hybridflow_{name}_{digest}", sources=[str(s) for s in staged],
                                      build_directory=str(build), verbose=False, **flags)
    except Exception as exc:  # compiler missing, headers missing, ...
        raise BackendUnavailable(f"could not build {', '.join(s.name for s in sources)}: {exc}") from exc


def _stage_sources(into: Path, files: list[Path]) -> list[Path]:
    """Copies of `files` (sources, then headers) in `into`, the build's own directory, returned in order.

    torch's build files name their sources' paths, so a build of the same bytes from another checkout (a
    fresh clone, a worktree) would compile again; compiled from copies under the content digest, every
    checkout holding these bytes loads the one build. Headers lie beside the sources, as `#include "x.h"`
    expects. A copy is written whole (`common.atomic_write`), so a killed copy leaves none."""
    into.mkdir(exist_ok=True)
    staged = []
    for path in files:
        copy = into / path.name
        data = path.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            atomic_write(copy, lambda f: f.write(data))
        staged.append(copy)
    return staged


@contextlib.contextmanager
def build_lock(build: Path):
    """Hold an flock on `build/.hybridflow-lock` while torch builds or loads in `build`.

    torch's own lock is a file, `build/lock`, that every build *and* every load of a cached build takes
    and deletes after; a process killed while holding it (a Ctrl-C or a test timeout during the first
    compile) leaves it, and every later process then waits on it forever. The kernel drops an flock when
    its holder dies, so under this one no live hybridflow process holds torch's file: one found is a dead
    process's and is removed.
    """
    import fcntl

    with open(build / ".hybridflow-lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build or load that was killed while holding it", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=None)
def build_cpu_extension(cpu_dir: Path = CSRC / "cpu", name: str = "cpu_kernels") -> ModuleType:
    """The C++ CPU kernels built from the sources in `cpu_dir`; raises BackendUnavailable with the reason.
    Another `name` builds (and caches) apart: torch's build files name their sources' paths, so one build
    directory shared by two source trees would rebuild each time it changed hands."""
    return _build(name, [cpu_dir / f for f in ("kernels.cpp", "decode.cpp", "layers.cpp")],
                  headers=(cpu_dir / "layers.h",),
                  # -fno-trapping-math: the selects in exp and the sigmoid then vectorise (GCC otherwise keeps a
                  # branch, as a comparison could trap); no result changes, only floating-point trap semantics.
                  extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"], extra_ldflags=["-fopenmp"])


_cpu_builds: list[ModuleType] = []  # set by `using_cpu_build`, innermost last


def cpu_extension() -> ModuleType:
    """The compiled C++ CPU kernels (this checkout's, or the one `using_cpu_build` set)."""
    return _cpu_builds[-1] if _cpu_builds else build_cpu_extension()


@contextlib.contextmanager
def using_cpu_build(module: ModuleType):
    """Every kernel runs `module` (another build of csrc/cpu, e.g. a git revision's) inside the block:
    `hybridflow bench csrc` alternates two builds in one process."""
    _cpu_builds.append(module)
    try:
        yield module
    finally:
        _cpu_builds.pop()


@functools.lru_cache(maxsize=None)
def cuda_extension() -> ModuleType:
    """The compiled CUDA kernels (for the current device's architecture); raises BackendUnavailable."""
    if not torch.cuda.is_available():
        raise BackendUnavailable("no CUDA device (or torch was built without CUDA)")
    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    cuda = CSRC / "cuda"
    return _build(f"cuda_kernels_{arch}", [cuda / "binding.cpp", cuda / "logprob_entropy.cu", cuda / "gae.cu"],
                  headers=(cuda / "logprob_entropy.h", cuda / "gae.h"), extra_cflags=["-O3"],
                  extra_cuda_cflags=["-O3"])


_EXTENSIONS = {"cpu": cpu_extension, "cuda": cuda_extension}  # backend name == device type it runs on


def resolve(backend: str, device: torch.device, available: tuple[str, ...]) -> str:
    """The concrete backend to run for `backend` on `device`.

    `available` lists the non-reference backends this kernel implements.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend == "reference":
        return backend
    if backend != "auto":
        if backend not in available:
            raise BackendUnavailable(f"this kernel has no {backend!r} backend (has: {available})")
        if backend in _EXTENSIONS:
            if device.type != backend:  # an extension reads raw pointers of its own device only
                raise BackendUnavailable(f"the {backend!r} backend runs on {backend} tensors, got {device}")
            _EXTENSIONS[backend]()
        return backend
    if device.type in _EXTENSIONS and device.type in available:
        try:
            _EXTENSIONS[device.type]()
            return device.type
        except BackendUnavailable as exc:
            warn_once(f"{device.type.upper()} kernels unavailable, using the PyTorch fallback: {exc}")
    return "chunked" if "chunked" in available else "reference"


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    log.warning(message)


def prebuild() -> None:
    """`make install` builds the C++ CPU kernels once, as pip builds an extension; without a compiler the
    kernels fall back to PyTorch, as they do at run time, and this says why."""
    import time

    started = time.perf_counter()
    try:
        build_cpu_extension()
        print(f"hybridflow: C++ CPU kernels built ({time.perf_counter() - started:.0f} s, cached under {_cache_dir()})")
    except BackendUnavailable as exc:
        print(f"hybridflow: C++ CPU kernels not built, the PyTorch kernels will run: {exc}")
