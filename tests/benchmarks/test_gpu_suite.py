"""The GPU suite imports and explains itself without CUDA; it is only run on a GPU (see its docstring)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu_suite.py"


def test_gpu_suite_help():
    proc = subprocess.run([sys.executable, str(SUITE), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--quick", "--peak-tbps", "--only"):
        assert flag in proc.stdout, proc.stdout


def test_gpu_suite_imports_without_cuda():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.main) and set(module.LOGPROB_FNS) == {"eager", "chunked", "cuda"}
