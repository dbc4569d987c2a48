"""Small helpers shared across layers: "did you mean" names, one-line values, seed mixing, loading a
user's Python file, writing a directory atomically.

They import nothing from hybridflow, so any layer may use them (a leaf, docs/design.md section 2). The
user-facing `from hybridflow.utils import load_hf_model` is `hybridflow/utils.py`, a module at the top.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import reprlib
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Optional

__all__ = ["SEED_STRIDE", "load_source_file", "mix_seed", "nearest_name", "shown_value", "write_dir_atomically"]


def nearest_name(name: str, choices: Iterable[str], cutoff: float = 0.5,
                 ignore_case: bool = False) -> Optional[str]:
    """The choice closest to a mistyped `name` (for "did you mean" hints), or None."""
    choices = list(choices)
    if ignore_case:
        lowered = {c.lower(): c for c in choices}
        match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=cutoff)
        return lowered[match[0]] if match else None
    match = difflib.get_close_matches(name, choices, n=1, cutoff=cutoff)
    return match[0] if match else None


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 80, 80


def shown_value(value: Any) -> str:
    """`repr(value)` for a one-line error message, cut to ~200 characters without building the whole repr
    (a user's value may be a huge list)."""
    text = _REPR.repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


SEED_STRIDE = 1_000_003  # a prime above any step count or dataset row a run reaches


def mix_seed(seed: Any, key: Any) -> Any:
    """A derived seed from a base seed and a key (a step, or dataset rows as a LongTensor).

    Distinct (seed, key) pairs give distinct seeds while key < SEED_STRIDE;
    every place that derives a per-step or per-row seed uses this one rule.
    """
    return seed * SEED_STRIDE + key


def load_source_file(path: Path, prefix: str) -> ModuleType:
    """Import a user's Python file (a reward or environment given as `file.py:function`) without packaging.

    The module gets a stable name unique to the file (`prefix`, stem, a digest of the resolved path):
    functions defined there pickle by reference within this process, and two files named rewards.py do
    not clash.
    """
    resolved = Path(path).resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"{prefix}_{resolved.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def write_dir_atomically(dst: Path, write: Callable[[Path], None], tag: str) -> Path:
    """`write(tmp)` into an empty hidden sibling of `dst` (`.NAME.TAG-tmp-PID`), then rename it to `dst`.

    An existing `dst` is moved aside (`.NAME.TAG-old-PID`) and removed only after the new one is in place:
    `dst` is never half-written. An exception removes the partial output and puts the old `dst` back; a
    process killed between the two renames leaves no `dst` and the old one under its hidden name (the PID
    lets a later run tell a killed writer's leftovers from a live one's and restore it, as the reshard tool
    does). One writer per `dst` at a time. Returns `dst` (absolute).
    """
    dst = Path(dst).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{tag}-tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    old = None
    try:
        write(tmp)
        if dst.exists():
            old = dst.with_name(f".{dst.name}.{tag}-old-{os.getpid()}")
            os.replace(dst, old)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not dst.exists():
            os.replace(old, dst)
        raise
    if old is not None:
        shutil.rmtree(old)
    return dst
