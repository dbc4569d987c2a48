"""Launching test scripts on N gloo processes with torchrun, from a clean environment."""
import json
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


def torchrun_scripts(nproc: int, scripts: list[dict], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run several scripts in turn in one launch of `nproc` processes (tests/run_scripts.py): each entry is
    {"script": path below the repo, "args": [...], "stdout": where rank 0's prints go, or None}."""
    spec = [{"script": s["script"], "args": [str(a) for a in s.get("args", ())],
             "stdout": None if s.get("stdout") is None else str(s["stdout"])} for s in scripts]
    return torchrun("tests/run_scripts.py", nproc, json.dumps(spec), timeout=timeout)
