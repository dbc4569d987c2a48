"""Launching a test script on N gloo processes with torchrun, from a clean environment."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun(script: str, nproc: int, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` (a path below the repo) on `nproc` processes; fails the test with its stderr tail."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(REPO / script), *map(str, args)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
