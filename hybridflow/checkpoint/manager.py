"""Checkpoint directories that are either complete or absent.

    root/step_000010/     one directory per saved step (contents: the trainer's)
    root/step_000010/manifest.json   every file of the step, its size and (small files) its sha256,
                                     written last
    root/latest           "step_000010": the last step saved, written atomically
    root/.tmp-step_000020-<pid>/   a save in progress, or a crashed one

`CheckpointManager.save(step, write)` lets `write` fill a hidden temporary
directory, records its manifest, fsyncs it, and only then renames it to
`step_XXXXXX`, so a crash or a full disk mid-save never leaves a half-written
step that `latest()` would pick. A step damaged afterwards (a shard deleted
or truncated, an emptied directory, a metadata file such as trainer.json
overwritten at the same size) fails its manifest check, and `latest()`
falls back to the newest intact step, with a warning naming what it skipped.
The caller decides what goes inside (the trainer: every rank's engine shard
and trainer.json, `format.py`; the reshard tool: the shards it converted).
Only one process saves into a root.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

from hybridflow.checkpoint.format import LATEST, MANIFEST, STEP_DIR, CheckpointError, step_dirname
from hybridflow.common import atomic_write, atomic_write_json, fsync_dir, fsync_tree, pid_alive

log = logging.getLogger(__name__)
_PARTIAL = re.compile(r"^\.(tmp|old|pruned)-(step_\d+)-(\d+)$")
# Files up to this size (metadata: trainer.json, ...) also get a sha256 in the manifest, since an edit that keeps
# the size passes the size check; shards are only sized, as hashing them would read gigabytes on every resume.
HASHED_UP_TO = 1 << 20


# A write that fails for want of space: the errnos, and the texts that say so where no errno survives (torch's
# zip writer reports a short write as "[enforce fail at inline_container.cc:672] . unexpected pos N vs M"; a
# worker's error arrives on the controller as text).
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("unexpected pos", "PytorchStreamWriter failed writing", os.strerror(errno.ENOSPC),
               os.strerror(errno.EDQUOT))
# A failed write with less than this left on its filesystem is taken as the disk filling up.
_NEARLY_FULL = 1 << 20


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} bytes"


def _ran_out_of_space(exc: Optional[BaseException]) -> bool:
    """Whether `exc` or an error it was raised from says the disk (or the quota) is full."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code = exc.errno if isinstance(exc, OSError) else (getattr(exc, "os_error", None) or (None,))[0]
        if code in _FULL_ERRNOS or any(text in str(exc) for text in _FULL_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class CheckpointManager:
    """Saves step directories under `root`, keeping the newest `keep_last` (<= 0: all).

    The `latest` marker, not the highest step number, says which checkpoint
    is current (as in verl and Megatron), so a run resumed from an older step
    carries on from its own saves.
    """

    def __init__(self, root: Path | str, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        self._recover()

    def step_dir(self, step: int) -> Path:
        return self.root / step_dirname(step)

    def all_steps(self) -> list[int]:
        """Steps with a complete checkpoint directory, ascending."""
        steps = []
        for entry in self.root.iterdir():
            match = STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> Optional[tuple[int, Path]]:
        """(step, directory) of the last intact checkpoint saved, or None when there is none.

        The `latest` marker decides; if it is missing, unreadable or names a
        directory that no longer exists, the newest step directory is used
        instead. A step that fails its manifest check (`damage`) is skipped,
        with a warning, for the one saved before it.
        """
        marked, steps = self._read_marker(), self.all_steps()
        if marked is not None and self.step_dir(marked).is_dir():
            candidates = [marked] + [s for s in reversed(steps) if s < marked]
        else:
            candidates = list(reversed(steps))
        for step in candidates:
            why = self.damage(self.step_dir(step))
            if why is None:
                return step, self.step_dir(step)
            log.warning("skipping checkpoint %s: %s", self.step_dir(step), why)
        return None

    def resume_point(self) -> Optional[tuple[int, Path]]:
        """`latest()`, for a resume: None only when no step was saved here. When steps exist but none is
        intact, a CheckpointError: starting over would truncate the run's metrics and prune those steps."""
        found = self.latest()
        if found is None and self.all_steps():
            why = "; ".join(f"{step_dirname(s)}: {self.damage(self.step_dir(s)) or 'after the latest marker'}"
                            for s in self.all_steps())
            raise CheckpointError(-1, f"trainer.resume=auto: no intact checkpoint under {self.root} ({why}); "
                                      "repair or move them, or start over with trainer.resume=disable "
                                      "trainer.overwrite=true")
        return found

    @staticmethod
    def damage(directory: Path) -> Optional[str]:
        """Why a step directory cannot be resumed from, or None when its files match its manifest.

        A non-empty directory without a manifest (saved before manifests) is
        taken as it is: there is nothing to check it against.
        """
        manifest = directory / MANIFEST
        if not manifest.is_file():
            return None if any(directory.iterdir()) else "it is empty"
        try:
            saved = json.loads(manifest.read_text())
            expected = {str(name): int(size) for name, size in saved["files"].items()}
            digests = {str(name): str(digest) for name, digest in saved.get("sha256", {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"its {MANIFEST} is unreadable"
        for name, size in expected.items():
            path = directory / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {size} were saved"
        for name, digest in digests.items():
            if (directory / name).is_file() and _sha256(directory / name) != digest:
                return f"{name} is not the file that was saved (same size, other content)"
        return None

    def save(self, step: int, write: Callable[[Path], None], expected_bytes: int = 0) -> Path:
        """Run `write(tmp_dir)`, then publish tmp_dir as `root/step_XXXXXX` and return it.

        First the free space is checked against what the step will take: the
        newest saved step's size, or `expected_bytes` (the caller's floor) if
        larger; too little is a full-disk CheckpointError before anything is
        written. If `write` (or the fsync) fails, the temporary directory is
        removed, existing checkpoints and the marker are left as they were,
        and a CheckpointError naming the step is raised from the original
        error; a full-disk one when the error says the space ran out.
        """
        final = self.step_dir(step)
        need, free = max(expected_bytes, self._newest_size()), shutil.disk_usage(self.root).free
        if need > free:
            raise CheckpointError(step, f"checkpoint step {step} was not saved: No space left on device (it needs "
                                        f"about {_size(need)}, {_size(free)} are free; nothing was written, earlier "
                                        "checkpoints are untouched)", errno.ENOSPC, final)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write(tmp)
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            digests = {name: _sha256(tmp / name) for name, size in files.items() if size <= HASHED_UP_TO}
            atomic_write_json(tmp / MANIFEST, {"step": step, "files": files, "sha256": digests})
            fsync_tree(tmp)
        except Exception as exc:
            full = _ran_out_of_space(exc) or shutil.disk_usage(self.root).free < _NEARLY_FULL
            shutil.rmtree(tmp, ignore_errors=True)
            said = (str(exc).strip().splitlines() or [""])[0]
            if full:
                raise CheckpointError(step, f"checkpoint step {step} was not saved: No space left on device "
                                            f"({type(exc).__name__}: {said}; earlier checkpoints are untouched)",
                                      errno.ENOSPC, final) from exc
            raise CheckpointError(step, f"checkpoint step {step} was not saved to {final}: "
                                        f"{type(exc).__name__}: {exc}") from exc
        except BaseException:  # KeyboardInterrupt: clean up, re-raise unchanged
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._publish(tmp, final)
        self._write_marker(final.name)
        self._prune(step)
        return final

    def _newest_size(self) -> int:
        """Bytes in the newest step directory (0 when none): what the next save will take, about."""
        steps = self.all_steps()
        if not steps:
            return 0
        return sum(p.stat().st_size for p in self.step_dir(steps[-1]).rglob("*") if p.is_file())

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():
            # A directory cannot be replaced by rename; move the old one aside
            # first. A crash in between leaves `.old-…`, which _recover restores.
            old = self.root / f".old-{final.name}-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(self.root)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
            fsync_dir(self.root)

    def _write_marker(self, name: str) -> None:
        atomic_write(self.root / LATEST, lambda f: f.write(f"{name}\n".encode()))

    def _read_marker(self) -> Optional[int]:
        try:
            text = (self.root / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):  # missing, unreadable, or not text: fall back to the steps
            return None
        match = STEP_DIR.match(text)
        return int(match.group(1)) if match else None

    def _prune(self, saved: int) -> None:
        """Keep `saved` and the newest keep_last-1 steps before it.

        Steps after `saved` are from a run abandoned by a resume (a crash
        after publishing a step but before its marker, or a manual rollback):
        `latest()` no longer points at them, so they are deleted too.
        """
        if self.keep_last <= 0:
            return
        older = [s for s in self.all_steps() if s < saved]
        doomed = older[:max(len(older) - (self.keep_last - 1), 0)]
        doomed += [s for s in self.all_steps() if s > saved]
        self._delete(doomed)

    def _delete(self, steps: list[int]) -> None:
        for step in steps:  # renamed away first (atomic), so an interrupted delete leaves no half step
            gone = self.root / f".pruned-{self.step_dir(step).name}-{os.getpid()}"
            os.rename(self.step_dir(step), gone)
            shutil.rmtree(gone, ignore_errors=True)

    def clear(self) -> None:
        """Start over (trainer.overwrite): no marker and no step of a previous run is left to resume from."""
        (self.root / LATEST).unlink(missing_ok=True)
        fsync_dir(self.root)
        self._delete(self.all_steps())

    def _recover(self) -> None:
        """Clean up after saves that crashed (their process is gone)."""
        for entry in self.root.iterdir():
            match = _PARTIAL.match(entry.name)
            if not match or pid_alive(int(match.group(3))):
                continue
            kind, name = match.group(1), match.group(2)
            if kind == "old" and not (self.root / name).exists():
                os.rename(entry, self.root / name)  # crashed between the two renames
            else:
                shutil.rmtree(entry, ignore_errors=True)
