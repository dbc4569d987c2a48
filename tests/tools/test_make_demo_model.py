"""tools/make_demo_model.py and what it ships: the demo model and the arithmetic splits."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.data.dataset import read_rows
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.models.checkpoint import load_decoder

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "make_demo_model.py"
ASSETS = REPO / "hybridflow" / "assets"
MODEL_DIR = ASSETS / "demo_model"
DATA_DIR = ASSETS / "arithmetic"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("make_demo_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _prompts(path: Path) -> set[str]:
    return {row["prompt"][0]["content"] for _, row in read_rows(path)}


def test_shipped_model_is_warm_but_not_solved(tool):
    model = load_decoder(MODEL_DIR)
    assert model.cfg.vocab_size == 16 and model.cfg.model_type == "llama"
    tokenizer = Tokenizer.from_path(MODEL_DIR)
    assert tokenizer.vocab_size == 16
    test = tool.load_problems(tokenizer, DATA_DIR / "test.parquet")
    assert len(test) >= 500
    acc = tool.accuracy(model, test)
    assert 0.15 <= acc <= 0.55, f"held-out accuracy {acc:.1%} is outside 15-55%"


def test_shipped_tokenization_matches_the_rl_prompt_format(tool):
    tokenizer = Tokenizer.from_path(MODEL_DIR)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    # <bos> then one id per character; "0".."9" are 4..13, "+" 14, "=" 15.
    assert tokenizer.encode("042+917=") == [1, 4, 8, 6, 14, 13, 5, 11, 15]
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    test = tool.load_problems(tokenizer, DATA_DIR / "test.parquet")
    row = test.sequences[0].tolist()
    assert test.prompt_len == 9 and len(row) == 14 and row[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(row[test.prompt_len:], skip_special_tokens=True) == test.answers[0]


def test_shipped_splits_are_disjoint():
    train, sft, test = (_prompts(DATA_DIR / f"{name}.parquet") for name in ("train", "sft", "test"))
    assert len(test) >= 500 and len(train) >= 1000 and len(sft) >= 1000
    assert not test & train and not test & sft and not train & sft


def test_greedy_correct_matches_step_by_step_greedy_decoding(tool):
    model = load_decoder(MODEL_DIR).eval()
    test = tool.load_problems(Tokenizer.from_path(MODEL_DIR), DATA_DIR / "test.parquet")
    sub = tool.Problems(test.sequences[:64], test.prompt_len, test.prompts[:64], test.answers[:64])
    response = sub.sequences[:, sub.prompt_len:]
    decoded = tool.greedy_decode(model, sub.sequences[:, :sub.prompt_len], response.shape[1])
    assert torch.equal((decoded == response).all(-1), tool.greedy_correct(model, sub))


def test_tool_runs_end_to_end_with_tiny_settings(tool, tmp_path, capsys):
    assert tool.main(["--out", str(tmp_path), "--rl", "64", "--sft", "256", "--val", "64", "--test", "64",
                      "--batch-size", "32", "--max-steps", "4", "--eval-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "transformers check passed" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["in_band"] is False and summary["step"] in (0, 2, 4)
    data = tmp_path / "arithmetic"
    assert {len(_prompts(data / f"{n}.parquet")) for n in ("train", "sft", "test")} == {64, 256}
    model_dir = tmp_path / "demo_model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (model_dir / name).is_file(), name
    assert "NOT reached" in (model_dir / "README.md").read_text()
    assert load_decoder(model_dir).cfg.vocab_size == 16


def test_shipped_moe_sibling_is_warm_but_not_solved_on_the_same_tokenizer(tool):
    model = load_decoder(ASSETS / "demo_moe_model")
    assert model.cfg.model_type == "qwen3_moe" and (model.cfg.num_experts, model.cfg.moe_top_k) == (8, 2)
    assert model.cfg.moe_top_k * model.cfg.moe_intermediate_size == load_decoder(MODEL_DIR).cfg.intermediate_size
    assert (ASSETS / "demo_moe_model" / "tokenizer.json").read_bytes() == (MODEL_DIR / "tokenizer.json").read_bytes()
    test = tool.load_problems(Tokenizer.from_path(MODEL_DIR), DATA_DIR / "test.parquet")
    assert 0.15 <= tool.accuracy(model, test) <= 0.55


def test_moe_run_writes_the_sibling_and_leaves_the_data_alone(tool, tmp_path, capsys):
    assert tool.main(["--moe", "--out", str(tmp_path), "--rl", "64", "--sft", "256", "--val", "64", "--test", "64",
                      "--batch-size", "32", "--max-steps", "2", "--eval-every", "2"]) == 0
    assert "transformers check passed" in capsys.readouterr().out
    assert not (tmp_path / "arithmetic").exists() and not (tmp_path / "demo_model").exists()
    assert load_decoder(tmp_path / "demo_moe_model").cfg.is_moe
