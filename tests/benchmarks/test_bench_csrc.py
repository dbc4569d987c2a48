"""`bench csrc` builds a revision's C++ extension and alternates it with the checkout's (smoke run)."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_csrc_against_head_times_both_builds(tmp_path):
    out = tmp_path / "csrc.json"
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "bench", "csrc", "--baseline", "HEAD",
                           "--repeats", "1", "--prompts", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"generate", "fwd+bwd"}
    assert all(t > 0 for row in result["seconds"].values() for t in row.values())
    assert result["same_responses"] is True
