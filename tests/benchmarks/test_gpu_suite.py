"""The GPU suite imports and explains itself without CUDA; it is only run on a GPU (see its docstring)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_step_report_from_a_runs_metrics():
    """gpu_step's figures from trainer metrics: the 0.5B parameter count, stages and their remainder,
    tokens/s, the decode step against its roofline and the update's MFU, by hand."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_step
    from make_qwen_shaped_model import QWEN25_05B

    from hybridflow.models.config import DecoderConfig
    from hybridflow.planner.cost import total_params

    n = total_params(DecoderConfig.from_hf_dict(QWEN25_05B), divisible_by=1)
    assert n == 494_032_768  # Qwen2.5-0.5B's published count (tied embeddings once)
    first = {"timing/step_s": 60.0, "timing/rollout_s": 50.0, "timing/update_s": 9.0}  # compiles: left out
    step = {"timing/step_s": 4.0, "timing/rollout_s": 2.0, "timing/log_probs_s": 0.5, "timing/update_s": 1.0,
            "timing/reward_s": 0.1, "timing/prepare_wall_s": 3.0, "reshard/time_s": 0.2,
            "response/length_mean": 100.0, "response/length_max": 200.0, "batch/tokens": 256 * 300.0}
    report = gpu_step.step_report([first, step, step], QWEN25_05B, epochs=1, rows=256, peak_tbps=4.8,
                                  peak_tflops=989.0)
    assert report["stages"] == {"log_probs": 0.5, "reward": 0.1, "rollout": 2.0, "update": 1.0,
                                "other": pytest.approx(0.4)}
    assert report["tokens_per_s"] == pytest.approx(256 * 100 / 2.0)
    assert report["decode_step_ms"] == pytest.approx(2.0 / 200 * 1e3)
    kv = 2 * 24 * 2 * 64 * 2 * 256 * (200 + 100)  # K and V, bf16, 256 rows at the mean context
    assert report["roofline_ms"] == pytest.approx((2 * n + kv) / 4.8e12 * 1e3)
    assert report["update_mfu"] == pytest.approx(6 * n * 256 * 300 / 1.0 / 989e12)
    assert report["transition_s"] == 0.2
