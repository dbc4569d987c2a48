"""tools/prepare_gsm8k.py on the real GSM8K files shipped in hybridflow/assets/gsm8k, and that copy itself."""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

from hybridflow.data import gsm8k
from hybridflow.data.dataset import PromptDataset, read_rows
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.rewards import default_reward

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "prepare_gsm8k.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def converted(tool, gsm8k_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    assert tool.main(["--src", str(gsm8k_dir), "--out", str(out)]) == 0
    return out


def test_default_source_is_the_shipped_copy(tool, gsm8k_dir):
    assert tool.DEFAULT_SRC.resolve() == gsm8k_dir == REPO / "hybridflow" / "assets" / "gsm8k"
    assert (gsm8k_dir / "LICENSE").read_text().startswith("MIT License")


@pytest.mark.parametrize("split,rows", [("train", 7473), ("test", 1319)])
def test_shipped_copy_is_gsm8k_as_published(gsm8k_dir, split, rows):
    """The gzipped files hold the published jsonl byte for byte: the digests in its README."""
    digests = dict(re.findall(r"`(\w+)\.jsonl\.gz` \| [\d,]+ \| `([0-9a-f]{64})`", (gsm8k_dir / "README.md").read_text()))
    data = gzip.decompress((gsm8k_dir / f"{split}.jsonl.gz").read_bytes())
    assert hashlib.sha256(data).hexdigest() == digests[split]
    assert data.count(b"\n") == rows


def test_split_file_takes_plain_before_gzip_and_names_both_when_absent(tmp_path):
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress(b'{"question": "q", "answer": "#### 1"}\n'))
    assert gsm8k.split_file(tmp_path, "train") == tmp_path / "train.jsonl.gz"
    assert gsm8k.questions(directory=tmp_path) == ["q"]
    (tmp_path / "train.jsonl").write_text('{"question": "plain", "answer": "#### 1"}\n\n')
    assert gsm8k.split_file(tmp_path, "train") == tmp_path / "train.jsonl"
    assert gsm8k.questions(directory=tmp_path) == ["plain"]
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "test.jsonl")) + ".*test.jsonl.gz"):
        gsm8k.split_file(tmp_path, "test")


def test_row_counts_and_format(converted, gsm8k_dir):
    train = [r for _, r in read_rows(converted / "train.parquet")]
    test = [r for _, r in read_rows(converted / "test.parquet")]
    assert (len(train), len(test)) == (7473, 1319)
    first = next(gsm8k.records(gsm8k_dir, "train"))
    r = train[0]
    assert r["data_source"] == "openai/gsm8k"
    assert r["prompt"] == [{"role": "user", "content": first["question"] +
                            " Let's think step by step and output the final answer after \"####\"."}]
    assert r["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert r["extra_info"] == {"split": "train", "index": 0, "answer": first["answer"],
                               "question": first["question"]}
    assert test[-1]["extra_info"]["split"] == "test" and test[-1]["extra_info"]["index"] == 1318
    with_commas = [r for r in train + test if "," in r["extra_info"]["answer"].rpartition("####")[2]]
    assert len(with_commas) > 50
    assert all(r["reward_model"]["ground_truth"].lstrip("-").isdigit() for r in train + test)


def test_prompt_dataset_loads_converted_files(converted, chatml_dir, make_cfg):
    tok = Tokenizer.from_path(chatml_dir)
    files = [converted / "train.parquet", converted / "test.parquet"]
    ds = PromptDataset(make_cfg(max_prompt_length=4096), tok, files)
    assert len(ds) == 7473 + 1319
    assert ds[0].prompt_text.startswith("<|im_start|>system\n") and ds[0].ground_truth == "72"
    last = ds[len(ds) - 1]
    assert default_reward(last.data_source, last.extra_info["answer"], last.ground_truth) == 1.0


def test_missing_source_is_named(tool, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        tool.convert(tmp_path / "nope.jsonl", tmp_path / "out.parquet", "train")
    assert tool.main(["--src", str(tmp_path / "absent"), "--out", str(tmp_path / "out")]) == 1
    assert str(tmp_path / "absent" / "train.jsonl") in capsys.readouterr().err


def test_bad_source_lines_are_named(tool, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "a\n#### 5"}) + "\n" +
                   json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: answer has no '#### <number>'"):
        tool.convert(src, tmp_path / "out.parquet", "train")
    src.write_text(json.dumps({"question": "q", "answer": "#### five"}) + "\n")
    with pytest.raises(ValueError, match="not a number"):
        tool.convert(src, tmp_path / "out.parquet", "train")
    assert not (tmp_path / "out.parquet").exists()
