"""Small helpers shared across layers: "did you mean" names, one-line values, seed mixing, loading a
user's Python file, a Ctrl-C handler's install and restore (`SigintHandler`), and the atomic writes: a
file (`atomic_write`, `atomic_write_json`, `atomic_torch_save`) and a directory (`write_dir_atomically`,
with `clear_dead_writes` for what a killed writer left).

They import nothing from hybridflow, so any layer may use them (a leaf, docs/design.md section 2). The
user-facing `from hybridflow.utils import load_hf_model` is `hybridflow/utils.py`, a module at the top.
"""
from __future__ import annotations

import abc
import difflib
import errno
import hashlib
import json
import importlib.util
import os
import reprlib
import shutil
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Callable, Iterable, Optional

__all__ = ["SEED_STRIDE", "SigintHandler", "atomic_torch_save", "atomic_write", "atomic_write_json",
           "clear_dead_writes", "fsync_dir", "fsync_tree", "load_source_file", "mix_seed", "nearest_name",
           "pid_alive", "shown_value", "write_dir_atomically"]


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


# --- atomic writes ---------------------------------------------------------------
# One implementation of each: the checkpoint manager, the trainer's trainer.json, the metrics file's truncation
# on resume, HF saves and the reshard tool all write through these.

def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable. Some filesystems refuse fsync on a directory (EINVAL); the rename
    is then as durable as that filesystem allows."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (before it is renamed into place)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def atomic_write(path: Path | str, write: Callable[[IO[bytes]], None]) -> None:
    """`write(f)` into a temporary sibling of `path` (`.NAME.tmp-PID`), fsync, then os.replace: readers see
    the old file or the new one, never half. An exception removes the temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path | str, obj: Any) -> None:
    """`obj` as indented JSON at `path`, atomically."""
    data = (json.dumps(obj, indent=2) + "\n").encode()
    atomic_write(path, lambda f: f.write(data))


def atomic_torch_save(obj: Any, path: Path | str) -> None:
    """`torch.save(obj, path)`, atomically (same argument order as torch.save)."""
    import torch

    atomic_write(path, lambda f: torch.save(obj, f))


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (someone else's counts): a leftover named with a live writer's PID is
    that writer's, not a crashed one's."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def write_dir_atomically(dst: Path, write: Callable[[Path], None], tag: str) -> Path:
    """`write(tmp)` into an empty hidden sibling of `dst` (`.NAME.TAG-tmp-PID`), then rename it to `dst`.

    An existing `dst` is moved aside (`.NAME.TAG-old-PID`) and removed only after the new one is in place:
    `dst` is never half-written. An exception removes the partial output and puts the old `dst` back; a
    process killed between the two renames leaves no `dst` and the old one under its hidden name (the PID
    lets `clear_dead_writes` tell a killed writer's leftovers from a live one's and restore it). One writer
    per `dst` at a time. Returns `dst` (absolute).
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


def clear_dead_writes(dst: Path, tag: str) -> None:
    """Clean up after `write_dir_atomically(dst, ..., tag)` calls that were killed (their process is gone): a
    partial output `.NAME.TAG-tmp-PID` is removed; an old `dst` moved aside (`.NAME.TAG-old-PID`, killed
    between the two renames) is put back where `dst` is missing, else removed."""
    dst = Path(dst).absolute()
    for entry in sorted(dst.parent.glob(f".{dst.name}.{tag}-*-*")):
        kind, pid = entry.name.rsplit("-", 2)[-2:]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        if kind == "old" and not dst.exists():
            os.replace(entry, dst)
        else:
            shutil.rmtree(entry, ignore_errors=True)


class SigintHandler(abc.ABC):
    """A `with` block during which SIGINT calls `self._on_sigint(signum, frame)`; the handler it replaced is
    restored on leaving. Python delivers signals to the main thread only, so elsewhere the block is inert
    (nothing installed, nothing restored)."""

    _previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    @abc.abstractmethod
    def _on_sigint(self, signum, frame) -> None:
        """What a Ctrl-C does inside the block."""
