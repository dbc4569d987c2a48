"""An interrupted conversion leaves nothing that looks complete: killed (SIGKILL) or stopped (Ctrl-C) while
it writes, DST is absent and only a hidden `.DST.reshard-tmp-PID` may remain, which the next run clears."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reshard.conftest import write_model

ROOT = Path(__file__).resolve().parents[2]
# ~80 MB in float32, 8 shard files at TP2 x PP4: long enough to be caught between two files.
BIG = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=8,
           num_key_value_heads=4, vocab_size=8192)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # tools/reshard.py in processes of its own


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "hf"
    write_model(path, "llama", **BIG)
    return path


def interrupt(src: Path, dst: Path, sig: int) -> subprocess.Popen:
    """Start tools/reshard.py and send `sig` once its first shard file is on disk (the run still writing)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools/reshard.py"), str(src), str(dst), "--to",
                             "hybridflow", "--tp", "2", "--pp", "4", "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tmp = dst.with_name(f".{dst.name}.reshard-tmp-{proc.pid}")
    deadline = time.monotonic() + 60
    while not any(tmp.glob("**/engine_*.pt")):
        assert proc.poll() is None, f"the conversion ended before it could be interrupted: {proc.stderr.read()}"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert proc.poll() is None, "the conversion ended before it could be interrupted"
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    return proc


def test_killed_conversion_leaves_no_dst_and_the_next_run_clears_it(tmp_path, big):
    proc = interrupt(big, tmp_path / "dst", signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "dst").exists()
    left = [p.name for p in tmp_path.iterdir()]
    assert left == [f".dst.reshard-tmp-{proc.pid}"]  # hidden, and named as what it is
    done = subprocess.run([sys.executable, str(ROOT / "tools/reshard.py"), str(big), str(tmp_path / "dst"),
                           "--to", "hybridflow", "--tp", "2", "--pp", "4", "--no-progress", "--verify"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "verified: 147 tensors equal SRC bit for bit" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # the dead run's temporary directory is gone


def test_ctrl_c_removes_the_partial_output(tmp_path, big):
    proc = interrupt(big, tmp_path / "dst", signal.SIGINT)
    assert proc.returncode != 0, proc.stderr.read()  # once 0 in the suite: what it printed, should it recur
    assert list(tmp_path.iterdir()) == []
