"""The JIT build's lock: a build or load killed while holding torch's lock file must not hang later ones."""
from __future__ import annotations

import fcntl
import subprocess
import sys

from hybridflow.kernels.backend import build_lock


def test_a_dead_processs_torch_lock_is_removed_under_ours(tmp_path, caplog):
    (tmp_path / "lock").touch()  # what torch's FileBaton leaves when its holder is killed
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "left by a build or load that was killed" in caplog.text
    with build_lock(tmp_path):  # nothing to remove: nothing said
        pass
    assert caplog.text.count("left by") == 1


def test_our_lock_excludes_another_process_and_dies_with_its_holder(tmp_path):
    """While one process holds the lock, another cannot take it; killed, its lock goes with it."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from hybridflow.kernels.backend import build_lock\n"
        f"with build_lock(Path({str(tmp_path)!r})):\n    print('held', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / ".hybridflow-lock", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                taken = True
            except BlockingIOError:
                taken = False
            assert not taken
            holder.kill()
            holder.wait(timeout=30)
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once its holder is dead
    finally:
        holder.kill()
