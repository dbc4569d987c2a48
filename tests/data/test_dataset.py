"""PromptDataset: reading, validation errors, overlong policies, collate, batching."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from hybridflow.data import fields as F
from hybridflow.data.dataset import (DatasetError, PromptDataset, batches_per_epoch, collate_prompts,
                                     iterate_batches, read_rows, write_parquet)
from hybridflow.data.tokenizer import Tokenizer, build_char_tokenizer


def row(content="042+917=", truth="0959", source="arithmetic", **extra):
    out = {"data_source": source, "prompt": [{"role": "user", "content": content}],
           "reward_model": {"style": "rule", "ground_truth": truth}}
    out.update(extra)
    return out


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def char_tok(char_dir):
    return Tokenizer.from_path(char_dir)


@pytest.fixture(scope="module")
def chat_tok(chatml_dir):
    return Tokenizer.from_path(chatml_dir)


# -- loading ---------------------------------------------------------------------

def test_loads_jsonl_and_parquet_in_order(tmp_path, char_tok, make_cfg):
    a = write_jsonl(tmp_path / "a.jsonl", [row("1+2="), row("33+4=", truth=37, extra_info={"k": 1})])
    b = write_parquet([row("5+6="), row("7+8=")], tmp_path / "b.parquet")
    ds = PromptDataset(make_cfg(), char_tok, [a, str(b)])
    assert len(ds) == 4
    assert [r.prompt_text for r in ds.records] == ["1+2=", "33+4=", "5+6=", "7+8="]
    assert [r.index for r in ds.records] == [0, 1, 2, 3]
    assert ds[1].input_ids == tuple(char_tok.encode("33+4="))
    assert ds[1].ground_truth == "37"  # numbers become text
    assert ds[1].extra_info == {"k": 1} and ds[0].extra_info == {}
    assert ds[2].messages == [{"role": "user", "content": "5+6="}]
    assert ds[3].data_source == "arithmetic"


def test_chat_template_is_applied_without_extra_specials(tmp_path, chat_tok, make_cfg):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "How many?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{**row(), "prompt": messages}])
    ds = PromptDataset(make_cfg(), chat_tok, path)
    expected = chat_tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ds[0].prompt_text == expected
    assert list(ds[0].input_ids) == chat_tok.encode(expected, add_special_tokens=False)
    plain = PromptDataset(make_cfg(apply_chat_template=False), chat_tok, path)
    assert plain[0].prompt_text == "Answer briefly.\nHow many?"


def test_bos_is_added_once(tmp_path, make_cfg):
    # The template writes BOS itself; the tokenizer would also add one on plain text.
    directory = build_char_tokenizer("0123456789+=", tmp_path / "tok", add_bos_token=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_path(directory)
    path = write_jsonl(tmp_path / "b.jsonl", [row("1+2=")])
    templated = PromptDataset(make_cfg(), tok, path)[0]
    plain = PromptDataset(make_cfg(apply_chat_template=False), tok, path)[0]
    expected = [tok.bos_token_id] + tok.encode("1+2=", add_special_tokens=False)
    assert list(templated.input_ids) == list(plain.input_ids) == expected
    assert templated.prompt_text == "<bos>1+2=" and plain.prompt_text == "1+2="


def test_parquet_nulls_in_messages_are_dropped(tmp_path, char_tok, make_cfg):
    # Parquet unifies struct fields across rows: the first message gains name=None.
    rows = [{**row(), "prompt": [{"role": "user", "content": "1+1="}]},
            {**row(), "prompt": [{"role": "user", "content": "2+2=", "name": "x"}]}]
    ds = PromptDataset(make_cfg(), char_tok, write_parquet(rows, tmp_path / "n.parquet"))
    assert ds[0].messages == [{"role": "user", "content": "1+1="}]
    assert ds[1].messages == [{"role": "user", "content": "2+2=", "name": "x"}]


# -- errors ------------------------------------------------------------------------

def test_missing_and_unsupported_files(tmp_path, char_tok, make_cfg):
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        PromptDataset(make_cfg(), char_tok, [tmp_path / "missing.parquet"])
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"data.csv.*unsupported.*\.parquet, \.jsonl"):
        PromptDataset(make_cfg(), char_tok, [csv])
    with pytest.raises(DatasetError, match="no dataset files"):
        PromptDataset(make_cfg(), char_tok, [])
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DatasetError, match="no rows"):
        PromptDataset(make_cfg(), char_tok, [empty])
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="broken.parquet"):
        PromptDataset(make_cfg(), char_tok, [broken])


BAD_ROWS = [
    ("{not json", "invalid JSON"),
    ('["a list"]', "row must be an object"),
    ({"data_source": "x", "reward_model": {"ground_truth": "1"}}, "missing 'prompt'"),
    ({**row(), "prompt": "1+1="}, "'prompt' must be a list"),
    ({**row(), "prompt": ["1+1="]}, "message 0 must be a dict"),
    ({**row(), "prompt": [{"content": "1+1="}]}, "message 0 has no 'role'"),
    ({**row(), "prompt": [{"role": "user", "content": 5}]}, "message 0 has no 'content'"),
    ({**row(), "prompt": []}, "empty prompt"),
    ({**row(), "prompt": [{"role": "system", "content": " "}, {"role": "user", "content": "\n\t"}]},
     "empty prompt"),
    ({**row(), "reward_model": {"style": "rule"}}, r"missing 'reward_model.ground_truth'"),
    ({k: v for k, v in row().items() if k != "reward_model"}, r"missing 'reward_model.ground_truth'"),
    ({**row(), "reward_model": {"ground_truth": True}}, "must not be a boolean"),
    ({k: v for k, v in row().items() if k != "data_source"}, "missing 'data_source'"),
    ({**row(), "extra_info": [1, 2]}, "'extra_info' must be an object"),
]


@pytest.mark.parametrize("bad,reason", BAD_ROWS)
def test_malformed_jsonl_row_names_file_line_and_reason(tmp_path, char_tok, make_cfg, bad, reason):
    path = write_jsonl(tmp_path / "rows.jsonl", [row(), "", row(), bad, row()])
    with pytest.raises(DatasetError, match=reason) as err:
        PromptDataset(make_cfg(), char_tok, [path])
    assert f"{path}:4:" in str(err.value)  # line 4: the blank line still counts


def test_malformed_parquet_row_names_row(tmp_path, char_tok, make_cfg):
    path = write_parquet([row(), row(), {**row(), "prompt": []}], tmp_path / "p.parquet")
    with pytest.raises(DatasetError, match=r"p.parquet:row 2: empty prompt"):
        PromptDataset(make_cfg(), char_tok, path)


def test_bad_config_values(tmp_path, char_tok, make_cfg):
    path = write_jsonl(tmp_path / "a.jsonl", [row()])
    with pytest.raises(ValueError, match="overlong_prompts"):
        PromptDataset(make_cfg(overlong_prompts="drop"), char_tok, path)
    with pytest.raises(ValueError, match="max_prompt_length"):
        PromptDataset(make_cfg(max_prompt_length=0), char_tok, path)


# -- overlong prompts --------------------------------------------------------------

@pytest.fixture
def mixed_lengths(tmp_path):
    return write_jsonl(tmp_path / "m.jsonl", [row("123"), row("1234567890"), row("12345"), row("1+2+3+4+5+")])


def test_filter_overlong(mixed_lengths, char_tok, make_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="hybridflow.data"):
        ds = PromptDataset(make_cfg(max_prompt_length=5, overlong_prompts="filter"), char_tok, mixed_lengths)
    assert [r.prompt_text for r in ds.records] == ["123", "12345"]
    assert [r.index for r in ds.records] == [0, 2]
    assert ds.num_overlong == 2
    assert "2 of 4 prompts longer than max_prompt_length=5 tokens were dropped" in caplog.text


@pytest.mark.parametrize("policy,kept", [("truncate_left", "67890"), ("truncate_right", "12345")])
def test_truncate_overlong(mixed_lengths, char_tok, make_cfg, caplog, policy, kept):
    ds = PromptDataset(make_cfg(max_prompt_length=5, overlong_prompts=policy), char_tok, mixed_lengths)
    assert len(ds) == 4
    assert ds[1].prompt_text == kept and ds[1].input_ids == tuple(char_tok.encode(kept))
    assert all(len(r.input_ids) <= 5 for r in ds.records)
    assert "2 of 4 prompts" in caplog.text and "truncated" in caplog.text


def test_error_on_overlong_names_row(mixed_lengths, char_tok, make_cfg):
    message = r"m.jsonl:2: prompt is 10 tokens, longer than max_prompt_length=5$"
    with pytest.raises(DatasetError, match=message):
        PromptDataset(make_cfg(max_prompt_length=5, overlong_prompts="error"), char_tok, mixed_lengths)


def test_all_filtered_is_an_error(mixed_lengths, char_tok, make_cfg):
    with pytest.raises(DatasetError, match="no usable prompts.*all 4 rows"):
        PromptDataset(make_cfg(max_prompt_length=2, overlong_prompts="filter"), char_tok, mixed_lengths)


# -- collate -----------------------------------------------------------------------

def test_collate_left_pads(tmp_path, char_tok, make_cfg):
    path = write_jsonl(tmp_path / "c.jsonl", [row("12", extra_info={"i": 0}), row("3+45="), row("6")])
    ds = PromptDataset(make_cfg(), char_tok, path)
    batch = ds.collate(ds.records)
    pad, ids = char_tok.pad_token_id, lambda s: char_tok.encode(s)
    assert batch[F.INPUT_IDS].dtype == torch.long
    assert batch[F.INPUT_IDS].tolist() == [[pad, pad, pad] + ids("12"), ids("3+45="), [pad] * 4 + ids("6")]
    assert batch[F.ATTENTION_MASK].tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert batch[F.POSITION_IDS].tolist() == [[0, 0, 0, 0, 1], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert batch[F.PROMPT_TEXT] == ["12", "3+45=", "6"]
    assert batch[F.INDEX] == [0, 1, 2]
    assert batch[F.GROUND_TRUTH] == ["0959"] * 3 and batch[F.DATA_SOURCE] == ["arithmetic"] * 3
    assert batch[F.EXTRA_INFO][0] == {"i": 0}
    assert batch[F.RAW_PROMPT][1] == [{"role": "user", "content": "3+45="}]
    assert set(batch) == set(F.PROMPT_TENSOR_FIELDS) | set(F.PROMPT_LIST_FIELDS)


def test_collate_pad_to_and_errors(tmp_path, char_tok, make_cfg):
    ds = PromptDataset(make_cfg(), char_tok, write_jsonl(tmp_path / "c.jsonl", [row("12"), row("345")]))
    batch = collate_prompts(ds.records, pad_token_id=7, pad_to=6)
    assert batch[F.INPUT_IDS].shape == (2, 6) and batch[F.INPUT_IDS][0, :4].tolist() == [7] * 4
    assert batch[F.POSITION_IDS][1].tolist() == [0, 0, 0, 0, 1, 2]
    with pytest.raises(ValueError, match="shorter than the longest"):
        collate_prompts(ds.records, pad_token_id=0, pad_to=2)
    with pytest.raises(ValueError, match="empty batch"):
        collate_prompts([], pad_token_id=0)


# -- batching ----------------------------------------------------------------------

@pytest.fixture
def ten(tmp_path, char_tok, make_cfg):
    path = write_jsonl(tmp_path / "t.jsonl", [row(str(i)) for i in range(10)])
    return PromptDataset(make_cfg(), char_tok, path)


def indices(batches):
    return [[r.index for r in b] for b in batches]


def test_iterate_batches_is_deterministic_and_resumable(ten):
    epoch0 = indices(iterate_batches(ten, 3, shuffle=True, seed=1, epoch=0))
    assert epoch0 == indices(iterate_batches(ten, 3, shuffle=True, seed=1, epoch=0))
    assert len(epoch0) == batches_per_epoch(10, 3) == 3 and all(len(b) == 3 for b in epoch0)
    flat = sum(epoch0, [])
    assert len(set(flat)) == 9 and flat != sorted(flat)
    assert epoch0 != indices(iterate_batches(ten, 3, shuffle=True, seed=1, epoch=1))
    assert epoch0 != indices(iterate_batches(ten, 3, shuffle=True, seed=2, epoch=0))
    assert indices(iterate_batches(ten, 3, True, 1, 0, start_step=2)) == epoch0[2:]
    assert list(iterate_batches(ten, 3, True, 1, 0, start_step=3)) == []


def test_iterate_batches_without_shuffle_or_drop_last(ten):
    assert indices(iterate_batches(ten, 4, shuffle=False, seed=0, epoch=5, drop_last=False)) == \
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches_per_epoch(10, 4, drop_last=False) == 3


def test_iterate_batches_errors(ten):
    with pytest.raises(ValueError, match="smaller than batch_size=11"):
        list(iterate_batches(ten, 11, shuffle=True, seed=0, epoch=0))
    with pytest.raises(ValueError, match="start_step=4"):
        list(iterate_batches(ten, 3, shuffle=True, seed=0, epoch=0, start_step=4))
    with pytest.raises(ValueError, match="batch_size must be positive"):
        list(iterate_batches(ten, 0, shuffle=True, seed=0, epoch=0))


def test_read_rows_locations(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [row(), "", row()])
    assert [where for where, _ in read_rows(path)] == [f"{path}:1", f"{path}:3"]
    parquet = write_parquet([row(), row()], tmp_path / "r.parquet")
    assert [where for where, _ in read_rows(parquet)] == [f"{parquet}:row 0", f"{parquet}:row 1"]


def test_write_parquet_is_atomic(tmp_path):
    path = write_parquet([row("1")], tmp_path / "sub" / "w.parquet")
    with pytest.raises(Exception):
        write_parquet([{"bad": object()}], path)
    assert [r for _, r in read_rows(path)][0]["prompt"][0]["content"] == "1"  # old file intact
    assert [p.name for p in path.parent.iterdir()] == ["w.parquet"]  # no temp files left
    with pytest.raises(ValueError, match="empty"):
        write_parquet([], path)
