"""The built-in addition task: generator, splits, parquet output and CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.data.arithmetic import format_problem, generate_arithmetic, generate_splits, main
from hybridflow.data.dataset import PromptDataset, read_rows
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.rewards import default_reward

REPO_ROOT = Path(__file__).resolve().parents[2]


def prompt_of(r):
    return r["prompt"][0]["content"]


def test_format_problem():
    assert format_problem(42, 917, 3) == ("042+917=", "0959")
    assert format_problem(999, 999, 3) == ("999+999=", "1998")
    assert format_problem(0, 0, 1) == ("0+0=", "00")
    with pytest.raises(ValueError, match="do not fit"):
        format_problem(1000, 1, 3)


def test_rows_are_correct_and_in_verl_format():
    rows = generate_arithmetic(200, digits=3, seed=0)
    assert len(rows) == 200 and len({prompt_of(r) for r in rows}) == 200
    for i, r in enumerate(rows):
        a, b = prompt_of(r)[:-1].split("+")
        assert len(a) == len(b) == 3 and prompt_of(r).endswith("=")
        truth = r["reward_model"]["ground_truth"]
        assert len(truth) == 4 and int(truth) == int(a) + int(b)
        assert r["data_source"] == "arithmetic" and r["prompt"][0]["role"] == "user"
        info = r["extra_info"]
        assert info["index"] == i and (info["a"], info["b"]) == (int(a), int(b))
    assert len({int(prompt_of(r)[:3]) for r in rows}) > 100  # operands actually vary


def test_deterministic_by_seed():
    assert generate_arithmetic(50, 3, seed=7) == generate_arithmetic(50, 3, seed=7)
    assert generate_arithmetic(50, 3, seed=7) != generate_arithmetic(50, 3, seed=8)


def test_whole_space_and_limits():
    rows = generate_arithmetic(100, digits=1, seed=3)
    assert sorted(prompt_of(r) for r in rows) == sorted(f"{a}+{b}=" for a in range(10) for b in range(10))
    with pytest.raises(ValueError, match="only 100 distinct"):
        generate_arithmetic(101, digits=1, seed=0)
    with pytest.raises(ValueError, match="digits"):
        generate_arithmetic(1, digits=0, seed=0)
    assert len(generate_arithmetic(3, digits=12, seed=0)) == 3  # huge spaces stay cheap


def test_splits_are_disjoint():
    train, test = generate_splits(900, 100, digits=2, seed=0)  # 10,000 possible problems
    assert len(train) == 900 and len(test) == 100
    assert not {prompt_of(r) for r in train} & {prompt_of(r) for r in test}
    assert {r["extra_info"]["split"] for r in train} == {"train"} and test[0]["extra_info"]["split"] == "test"
    assert generate_splits(900, 100, 2, 0) == (train, test)
    with pytest.raises(ValueError):
        generate_splits(60, 41, digits=1, seed=0)


def test_cli_writes_parquet_that_the_dataset_reads(tmp_path, char_dir, make_cfg):
    args = ["--out", str(tmp_path), "--train", "30", "--test", "10", "--digits", "3", "--seed", "1"]
    assert main(args) == 0
    tok = Tokenizer.from_path(char_dir)
    train = PromptDataset(make_cfg(max_prompt_length=8), tok, tmp_path / "train.parquet")
    test = PromptDataset(make_cfg(max_prompt_length=8), tok, tmp_path / "test.parquet")
    assert len(train) == 30 and len(test) == 10
    assert all(len(r.input_ids) == 8 for r in train.records)  # "ddd+ddd=" is 8 characters
    assert not {r.prompt_text for r in train.records} & {r.prompt_text for r in test.records}
    for r in test.records:
        assert default_reward(r.data_source, r.ground_truth + "<eos>", r.ground_truth) == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]


def test_cli_as_module_and_bad_arguments(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hybridflow.data.arithmetic", "--out", str(tmp_path),
                             "--train", "5", "--test", "2", "--digits", "2"],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "wrote 5 train problems" in result.stdout and "RuntimeWarning" not in result.stderr
    assert len(list(read_rows(tmp_path / "test.parquet"))) == 2
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--train", "100", "--test", "1", "--digits", "1"])


def test_chat_form_asks_in_words_and_is_scored_on_the_last_integer():
    train, test = generate_splits(5, 3, 2, seed=1, chat=True)
    row = train[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["data_source"] == "arithmetic_chat"
    assert prompt_of(row) == f"What is {a} + {b}? Answer with the number only."
    assert row["reward_model"]["ground_truth"] == str(a + b)  # a plain sum, no zero padding
    assert {prompt_of(r) for r in train}.isdisjoint(prompt_of(r) for r in test)
    truth = str(a + b)
    assert default_reward("arithmetic_chat", f"{a} + {b} = {truth}.", truth) == 1.0
    assert default_reward("arithmetic_chat", f"{truth} (not {a + b + 1})", truth) == 0.0
