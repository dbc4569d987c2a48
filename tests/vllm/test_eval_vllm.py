"""`hybridflow eval --engine vllm` on real vLLM (`make test-vllm`): the same scorer as the built-in engine,
and greedy answers equal to the built-in engine's (as the trainer's greedy validation is, test_flows.py)."""
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.trainer.evaluate import evaluate

pytest.importorskip("vllm", reason="the vLLM backend's tests run under `make test-vllm`")
pytestmark = pytest.mark.timeout(600)

ASSETS = Path(__file__).resolve().parents[2] / "hybridflow" / "assets"
DEMO, TEST = ASSETS / "demo_model", ASSETS / "arithmetic" / "test.parquet"


def test_eval_on_vllm_gives_the_builtin_engines_greedy_answers_and_accuracy(capsys):
    builtin = evaluate(DEMO, [TEST], ["arithmetic"], limit=16, max_new_tokens=6)
    on_vllm = evaluate(DEMO, [TEST], ["arithmetic"], limit=16, max_new_tokens=6, engine="vllm")
    assert on_vllm.engine == "vllm"
    assert on_vllm.prompts == builtin.prompts
    assert on_vllm.responses == builtin.responses  # greedy, float32: the same tokens
    assert on_vllm.scores == builtin.scores and on_vllm.accuracy("arithmetic") == builtin.accuracy("arithmetic")
    # The command line, one model (two side by side are the built-in engine's test; each model here is
    # one more vLLM engine to start). vLLM's own INFO lines go to stdout too, before the report.
    assert main(["eval", str(TEST), "--model", str(DEMO), "--engine", "vllm", "--reward", "arithmetic",
                 "--limit", "16", "--max-new-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "16 held-out prompts, greedy (vllm engine)" in lines
    assert f"  {DEMO}: arithmetic {builtin.accuracy('arithmetic'):.1%}" in lines
