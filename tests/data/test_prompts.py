"""hybridflow.data.prompts: rendering, the special-token rule and left padding, on character tokenizers."""
from __future__ import annotations

import json

import pytest
import torch

from hybridflow.data.prompts import adds_special_tokens, encode_prompts, left_pad, render_prompt
from hybridflow.data.tokenizer import Tokenizer, build_char_tokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789:+= \n"
# Writes BOS itself, as Llama-style templates do.
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]


def char_tokenizer(tmp_path, add_bos_token: bool, template: str | None = None) -> Tokenizer:
    out = build_char_tokenizer(CHARS, tmp_path / f"tok_{add_bos_token}_{template is not None}",
                               add_bos_token=add_bos_token)
    if template is not None:
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return Tokenizer.from_path(out)


def test_render_without_template_joins_the_contents(tmp_path):
    tok = char_tokenizer(tmp_path, add_bos_token=False)
    assert not tok.has_chat_template
    assert render_prompt(tok, MESSAGES, chat=False) == "be brief\n1+2="
    assert tok.render_prompt(MESSAGES) == "be brief\n1+2="
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(tok, MESSAGES, chat=True)


def test_render_with_template_appends_the_generation_prompt(tmp_path):
    tok = char_tokenizer(tmp_path, add_bos_token=True, template=BOS_TEMPLATE)
    text = render_prompt(tok, MESSAGES, chat=True)
    assert text == "<bos>system:be brief\nuser:1+2=\nassistant:"
    assert tok.render_prompt(MESSAGES) == text
    assert render_prompt(tok, MESSAGES, chat=False) == "be brief\n1+2="  # the dataset's apply_chat_template=False


def test_a_template_that_writes_bos_gets_no_second_one(tmp_path):
    tok = char_tokenizer(tmp_path, add_bos_token=True, template=BOS_TEMPLATE)
    bos = tok.bos_token_id
    text = render_prompt(tok, MESSAGES, chat=True)
    [ids] = encode_prompts(tok, [text], chat=True)
    assert ids[0] == bos and bos not in ids[1:]
    assert tok.encode(text, add_special_tokens=True)[:2] == [bos, bos]  # what the rule prevents
    assert ids == tok.encode(text, add_special_tokens=False)
    assert adds_special_tokens(chat=True) is False


def test_plain_text_gets_the_tokenizer_special_tokens(tmp_path):
    with_bos = char_tokenizer(tmp_path, add_bos_token=True)
    without = char_tokenizer(tmp_path, add_bos_token=False)
    assert adds_special_tokens(chat=False) is True
    assert encode_prompts(with_bos, ["1+2="], chat=False) == [[with_bos.bos_token_id] + without.encode("1+2=")]
    assert encode_prompts(without, ["1+2="], chat=False) == [without.encode("1+2=")]
    assert encode_prompts(without, [], chat=False) == []


def test_left_pad_puts_real_tokens_on_the_right():
    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long and ids.device.type == "cpu"


def test_left_pad_width_device_and_empty_rows():
    ids, mask = left_pad([(1, 2), (), [3]], pad_id=7, pad_to=4, device=torch.device("cpu"))
    assert ids.tolist() == [[7, 7, 1, 2], [7, 7, 7, 7], [7, 7, 7, 3]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]]
    ids, mask = left_pad([[], []], pad_id=7)
    assert ids.shape == mask.shape == (2, 0)


def test_left_pad_rejects_no_rows_and_a_row_longer_than_the_width():
    with pytest.raises(ValueError, match="no prompts"):
        left_pad([], pad_id=0)
    with pytest.raises(ValueError, match=r"pad_to=2 is shorter than the longest prompt \(3 tokens\)"):
        left_pad([[1], [1, 2, 3]], pad_id=0, pad_to=2)
