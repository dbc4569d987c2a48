"""Context parallelism without Transformer Engine: GPTModel at cp = 2 (2 gloo ranks) equals cp = 1.

The check (cp_check.py) feeds each rank its load-balanced chunks; the logits gathered back and every
parameter's gradient (summed over the CP group) must equal the one-rank model's, for a Llama-shaped
model with GQA and a sliding-window one with a single KV head (and the GQA model's logits in
bfloat16); cp = 1 is checked to run megatron-core's own attention, cp = 2 the engine's. The same
comparison must fail when the positions are wrong (RoPE at the contiguous split's positions; the
contiguous split fed as if balanced), when the window is dropped, and when the K/V gather's backward
does not reduce-scatter: so a pass says the positions, the mask and the backward are right, not that
the check is blind. In the same launch, cp_engine_check.py runs the engine at cp = 2: its log-probs,
values and one update must equal one rank's.
"""
import json
from types import SimpleNamespace

import pytest
import torch


EQUAL = {"cp2", "cp2_rows"}
WRONG = {"wrong_rope", "contiguous", "slice_backward", "window_ignored"}


def test_core_attention_choice_keeps_cp1_as_megatron_builds_it():
    from hybridflow.engine.cp_attention import CpDotProductAttention, core_attention_for

    assert core_attention_for(SimpleNamespace(context_parallel_size=1), "cpu") is None
    assert core_attention_for(SimpleNamespace(context_parallel_size=2), "cpu") is CpDotProductAttention


@pytest.fixture(scope="module")
def launched(two_process_launch, layouts_hf):
    """cp_check.py (GPTModel) and cp_engine_check.py (the engine at cp = 2), in the suite's 2-process launch."""
    return {"model": json.loads(two_process_launch["cp"].read_text()),
            "engine": torch.load(two_process_launch["cp_engine"]), "hf": layouts_hf}


@pytest.fixture(scope="module")
def results(launched):
    return launched["model"]


@pytest.mark.timeout(540)
@pytest.mark.parametrize("model", ["llama_gqa", "sliding_window"])
def test_cp2_equals_cp1(results, model):
    for variant in EQUAL:
        diff = results[model][variant]
        assert diff["logits"] < 1e-5, (variant, diff)
        assert diff["grads"] < 1e-5, (variant, diff)  # relative to each parameter's largest gradient


@pytest.mark.timeout(540)
def test_cp2_equals_cp1_in_bfloat16(results):
    diff = results["bf16"]
    assert diff["logits"] <= 1e-2 * diff["scale"], diff  # bf16's float32 softmax, as the local path


@pytest.mark.timeout(540)
@pytest.mark.parametrize("model", ["llama_gqa", "sliding_window"])
def test_check_fails_on_wrong_positions_window_or_backward(results, model):
    wrong = WRONG if model == "sliding_window" else WRONG - {"window_ignored"}
    assert set(results[model]) == EQUAL | wrong, results[model].keys()
    for variant in wrong:
        diff = results[model][variant]
        assert max(diff["logits"], diff["grads"]) > 0.1, (variant, diff)
    assert results[model]["slice_backward"]["logits"] < 1e-5  # the forward is right; only gradients differ




@pytest.mark.timeout(540)
def test_engine_at_cp2_equals_one_rank(launched, megatron_world):
    """The engine's forward step at cp = 2: rows padded to 2*cp chunks, each rank its chunks, outputs
    gathered: the one-rank log-probs, entropy, values, gradient norm and updated weights."""
    from tests.engine.test_layouts import reference

    got, want = launched["engine"], reference(launched["hf"])
    assert got["same_on_cp_ranks"]
    for key in ("old_log_probs", "entropy", "values"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7), key
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, atol=1e-6, rtol=0, msg=name)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
