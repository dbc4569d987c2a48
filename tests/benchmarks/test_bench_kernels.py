"""The kernel benchmark runs end to end (quick shapes); its figures are not asserted."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_kernels_quick_prints_every_kernel():
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "bench", "kernels", "--quick"],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("gae B=64", "logprob+entropy 256x4096 fwd", "fwd+bwd", "fused linear"):
        assert name in proc.stdout, proc.stdout
