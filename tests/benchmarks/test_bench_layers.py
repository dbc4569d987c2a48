"""The layer-kernel benchmark runs end to end (quick shapes); its figures are not asserted."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_layers_quick_times_each_kernel_and_both_engines(tmp_path):
    out = tmp_path / "layers.json"
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "bench", "layers", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [row["kernel"] for row in result["kernels"]] == ["rms_norm", "swiglu", "rotary (q and k)"]
    assert result["engine"]["unfused_ms"] > 0 and result["engine"]["kernels_ms"] > 0
    assert "demo model fwd+bwd" in proc.stdout
