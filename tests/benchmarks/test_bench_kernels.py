"""The kernel benchmark runs end to end (quick shapes); its timings are not asserted."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_kernels_quick_prints_every_kernel(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "bench", "kernels", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("gae B=64", "logprob+entropy 256x4096 fwd", "fwd+bwd", "fused linear"):
        assert name in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    assert len(figures["kernels"]) == 6 and len(figures["logprob_backward_peak_rss"]) == 2
    for row in figures["kernels"]:  # every kernel and its reference carry a peak-memory figure
        assert row["ref_peak_mib"] is not None and row["ours_peak_mib"] is not None, row
    # The reference's fwd+bwd keeps softmax and its gradient: it allocates more than the [256, 4096] logits.
    logprob = next(r for r in figures["kernels"] if r["kernel"] == "logprob+entropy 256x4096 fwd+bwd")
    assert logprob["ref_peak_mib"] >= 4.0, logprob
