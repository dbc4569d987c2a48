"""Backend selection for kernels, and the once-compiled C++ CPU extension.

Every kernel has a `reference` (plain PyTorch) and faster backends:

- `cpu`: the C++ extension in `csrc/cpu/`, JIT-compiled on first use with
  the machine's own flags (-O3 -march=native, OpenMP) and cached under
  `$HYBRIDFLOW_CACHE` (default `~/.cache/hybridflow`), so later processes
  load it in well under a second;
- `chunked`: plain PyTorch processed in chunks of tokens (memory-lean on any
  device) for kernels where that matters;
- `cuda`/`triton`: GPU kernels, only where a GPU toolchain exists;
- `auto`: the fastest one available for the input's device (C++ on CPU,
  `chunked` elsewhere when the kernel has it), else `reference`.

When an extension cannot be built, `auto` falls back to the reference and
says so once in the log; asking for that backend by name raises instead.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("hybridflow.kernels")
BACKENDS = ("reference", "chunked", "cpu", "cuda", "triton", "auto")
CSRC = Path(__file__).resolve().parents[2] / "csrc"


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run here."""


def _cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDFLOW_CACHE", Path.home() / ".cache" / "hybridflow"))


@functools.lru_cache(maxsize=None)
def cpu_extension() -> ModuleType:
    """The compiled C++ CPU kernels; raises BackendUnavailable with the reason."""
    source = CSRC / "cpu" / "kernels.cpp"
    if not source.is_file():
        raise BackendUnavailable(f"C++ source not found: {source}")
    from torch.utils import cpp_extension

    digest = hashlib.sha1(source.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    build = _cache_dir() / f"cpu_kernels_{digest}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=f"hybridflow_cpu_kernels_{digest}", sources=[str(source)], build_directory=str(build),
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # compiler missing, headers missing, ...
        raise BackendUnavailable(f"could not build {source}: {exc}") from exc


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
        if backend == "cpu":
            cpu_extension()
        return backend
    if device.type == "cpu" and "cpu" in available:
        try:
            cpu_extension()
            return "cpu"
        except BackendUnavailable as exc:
            _warn_once(f"C++ CPU kernels unavailable, using the PyTorch fallback: {exc}")
    return "chunked" if "chunked" in available else "reference"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning(message)
