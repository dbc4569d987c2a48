"""vLLM at tensor parallel 2 inside a 2-process gloo job (`external_launcher`), on real vLLM (`make test-vllm`).

tp_check.py runs on two processes per model shape (Llama-shaped, and Qwen2-shaped with QKV bias and tied
embeddings; two KV heads so each rank holds one), and on four processes as two engines: each rank holds only its generation shard and pushes
whole HF tensors gathered entry by entry over the group, in 1 MiB buckets. Tolerances (float32, vLLM's
CPU kernels against the built-in tg = 2 generator): greedy tokens equal; their log-probs within
LOGPROB_ATOL (measured: about 2e-5). The stale case (no push after the update) must fail the comparison.
"""
import json

import pytest

from tests.torchrun import torchrun

pytest.importorskip("vllm", reason="the vLLM backend's tests run under `make test-vllm`")
pytestmark = pytest.mark.timeout(900)

LOGPROB_ATOL = 1e-4
BUCKET = 2**20


def _check(tmp_path, shape: str, mode: str = "push", nproc: int = 2) -> dict:
    out = tmp_path / "out.json"
    torchrun("tests/vllm/tp_check.py", nproc, shape, out, mode, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("shape", ["llama", "qwen2"])
def test_vllm_at_tp2_generates_as_the_builtin_tg2_engine_after_every_push(tmp_path, shape):
    r = _check(tmp_path, shape)
    assert r["vllm_tp_groups"] == [[0, 1], [0, 1]]
    assert r["greedy_equal"] and r["distinct_tokens"] > 10
    assert r["greedy_logprob_max_diff"] <= LOGPROB_ATOL
    assert r["ranks_sampled_alike"] and r["sampled_tokens"] > 0  # one engine: both ranks hold the same rows
    assert r["changed_by_update"] and r["after_push_equal"]
    assert r["after_logprob_max_diff"] <= LOGPROB_ATOL
    for push in (r["first"], r["second"]):
        assert push["reshard/push_bytes"] == r["model_bytes"]  # every rank loads whole tensors; vLLM cuts
        # No rank held the whole model: its own shard, and one bucket of whole tensors at a time.
        assert push["reshard/push_peak_bytes"] <= BUCKET < r["model_bytes"]
        # What the gathers brought in: the peer's half of every sharded tensor (vocabulary padded).
        assert 0.45 * r["model_bytes"] < push["reshard/push_gather_bytes"] < 0.55 * r["model_bytes"]


def test_two_generation_replicas_are_two_vllm_engines(tmp_path):
    """Four processes at tg = 2: vLLM cuts the world into blocks of consecutive ranks, one engine each (its
    'external' data parallelism: the engines never talk to each other); both answer as the built-in engine."""
    r = _check(tmp_path, "llama", nproc=4)
    assert r["vllm_tp_groups"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert r["greedy_equal"] and r["after_push_equal"] and r["ranks_sampled_alike"]
    assert r["first"]["reshard/push_peak_bytes"] <= BUCKET < r["model_bytes"]


def test_a_stale_push_fails_the_comparison(tmp_path):
    """The check above has teeth: without the push after the update vLLM answers with the old weights."""
    r = _check(tmp_path, "qwen2", mode="stale")
    assert r["greedy_equal"] and r["changed_by_update"]
    assert not r["after_push_equal"]
