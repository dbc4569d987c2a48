"""Tokenizer: parity with transformers on a locally trained BPE, SentencePiece,
the character tokenizer, chat templates and error messages."""
from __future__ import annotations

import json
import pickle

import jinja2
import pytest
import sentencepiece
import torch
from transformers import PreTrainedTokenizerFast

from hybridflow.data import gsm8k
from hybridflow.data.tokenizer import Tokenizer, build_char_tokenizer

TEXTS = [
    "Natalia sold clips to 48 of her friends in April.",
    "  leading and trailing spaces  ",
    "multi\nline\n\ttext",
    "héllo 🙂 naïve – “quotes”",
    "special <|im_start|>user\nhi<|im_end|> inside",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "  padded question  \n"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "héllo 🙂", "name": None}],
]

# Indented blocks without `{%-`: the output depends on trim_blocks/lstrip_blocks.
LLAMA_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
{{ ' ' + message['content'] + eos_token }}
    {% else %}
{{ raise_exception('only user and assistant roles are supported') }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ ' ' }}{% endif %}"""


@pytest.fixture(scope="module")
def hf_chatml(chatml_dir):
    return PreTrainedTokenizerFast.from_pretrained(str(chatml_dir))


@pytest.fixture(scope="module")
def ours(chatml_dir):
    return Tokenizer.from_path(chatml_dir)


# -- tokenizer.json parity ---------------------------------------------------

@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(ours, hf_chatml, gsm8k_dir, add_special):
    questions = gsm8k.questions(100, gsm8k_dir, "test")
    for text in TEXTS + questions:
        assert ours.encode(text, add_special_tokens=add_special) == \
            hf_chatml.encode(text, add_special_tokens=add_special), text
    assert ours.encode_batch(questions) == [hf_chatml.encode(q) for q in questions]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, hf_chatml, skip):
    specials = [ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")]
    for text in TEXTS:
        ids = specials[:1] + ours.encode(text) + specials[1:]
        assert ours.decode(ids, skip_special_tokens=skip) == hf_chatml.decode(ids, skip_special_tokens=skip)
    ids = ours.encode(TEXTS[0])
    assert ours.decode(ids) == TEXTS[0]


def test_special_ids_and_vocab_match_transformers(ours, hf_chatml):
    assert ours.eos_token_id == hf_chatml.eos_token_id == ours.token_to_id("<|im_end|>")
    assert ours.pad_token_id == hf_chatml.pad_token_id == ours.token_to_id("<|endoftext|>")
    assert ours.bos_token_id is None and hf_chatml.bos_token_id is None
    assert ours.vocab_size == len(hf_chatml) == 600
    assert ours.id_to_token(ours.eos_token_id) == "<|im_end|>"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_template_matches_transformers(ours, hf_chatml, conversation, add_generation_prompt):
    expected = hf_chatml.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_trim_and_lstrip_blocks_and_bos_match_transformers(hf_dir):
    bos = {"__type": "AddedToken", "content": "<|im_start|>", "special": True}  # dict form, as HF saves it
    config = {"chat_template": LLAMA_TEMPLATE, "bos_token": bos, "eos_token": "<|im_end|>"}
    directory = hf_dir(config)
    ours, hf = Tokenizer.from_path(directory), PreTrainedTokenizerFast.from_pretrained(str(directory))
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"}]
    rendered = ours.apply_chat_template(conversation)
    assert rendered == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    # Block tags vanish with their newline and indentation; expression lines keep theirs.
    assert rendered == "<|im_start|>[INST] a [/INST]\n b<|im_end|>\n<|im_start|>[INST] c [/INST]\n "


def test_config_add_bos_eos_do_not_override_tokenizer_json(hf_dir):
    directory = hf_dir({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                        "add_bos_token": True, "add_eos_token": True})
    ours, hf = Tokenizer.from_path(directory), PreTrainedTokenizerFast.from_pretrained(str(directory))
    # transformers 5 ignores these flags when tokenizer.json exists: its post-processor decides.
    assert ours.encode("hi") == hf.encode("hi") == ours.encode("hi", add_special_tokens=False)
    assert ours.bos_token_id not in ours.encode("hi") and ours.eos_token_id not in ours.encode("hi")


def test_raise_exception_in_template(hf_dir):
    ours = Tokenizer.from_path(hf_dir({"chat_template": LLAMA_TEMPLATE, "bos_token": "<|im_start|>",
                                       "eos_token": "<|im_end|>"}))
    with pytest.raises(jinja2.TemplateError, match="only user and assistant roles"):
        ours.apply_chat_template([{"role": "system", "content": "x"}])


def test_template_sandbox_and_extras(hf_dir):
    template = ("{% generation %}{{ messages | tojson }}{% endgeneration %}"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m.content }}{% endfor %}"
                "{{ custom }}")
    ours = Tokenizer.from_path(hf_dir({"chat_template": template}))
    out = ours.apply_chat_template([{"role": "user", "content": "<é>"}, {"role": "user", "content": "no"}],
                                   custom="!")
    assert out == '[{"role": "user", "content": "<é>"}, {"role": "user", "content": "no"}]<é>!'
    evil = Tokenizer.from_path(hf_dir({"chat_template": "{{ messages.__class__.__mro__ }}"}, name="evil"))
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_render_prompt_with_and_without_template(ours, hf_dir):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "042+917="}]
    assert ours.render_prompt(messages) == ours.apply_chat_template(messages, add_generation_prompt=True)
    plain = Tokenizer.from_path(hf_dir({"eos_token": "<|im_end|>"}))
    assert not plain.has_chat_template
    assert plain.render_prompt(messages) == "sys\n042+917="
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template(messages)


def test_config_precedence_and_template_file(hf_dir):
    directory = hf_dir({"eos_token": "<|im_end|>", "chat_template": "from config"})
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": {"content": "<|im_start|>"}}))
    tok = Tokenizer.from_path(directory)
    assert tok.eos_token == "<|im_end|>"  # tokenizer_config.json wins
    assert tok.pad_token == "<|im_start|>"  # special_tokens_map.json fills the gap
    assert tok.apply_chat_template([]) == "from config"
    (directory / "chat_template.jinja").write_text("from file {{ eos_token }}")
    assert Tokenizer.from_path(directory).apply_chat_template([]) == "from file <|im_end|>"


def test_named_templates_pick_default(hf_dir):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert Tokenizer.from_path(hf_dir({"chat_template": templates})).apply_chat_template([]) == "plain"


def test_pad_falls_back_to_eos_and_unknown_specials_are_dropped(hf_dir, caplog):
    tok = Tokenizer.from_path(hf_dir({"eos_token": "<|im_end|>", "bos_token": "<not-in-vocab>"}))
    assert tok.pad_token_id == tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_token == "<|im_end|>"
    assert tok.bos_token_id is None and tok.bos_token is None
    assert "<not-in-vocab>" in caplog.text
    bare = Tokenizer.from_path(hf_dir(None, name="bare"))
    assert bare.eos_token_id is None and bare.pad_token_id is None and not bare.has_chat_template


def test_file_path_and_tensor_inputs(ours, chatml_dir):
    by_file = Tokenizer.from_path(chatml_dir / "tokenizer.json")
    assert by_file.eos_token_id == ours.eos_token_id and by_file.has_chat_template
    ids = ours.encode(TEXTS[0])
    batch = torch.tensor([ids, ids])
    assert ours.decode(torch.tensor(ids)) == TEXTS[0]
    assert ours.batch_decode(batch) == [TEXTS[0], TEXTS[0]]


def test_pickle_round_trip(ours):
    ours.apply_chat_template(CONVERSATIONS[0])  # compiles the template first
    clone = pickle.loads(pickle.dumps(ours))
    assert clone.encode(TEXTS[0]) == ours.encode(TEXTS[0])
    assert clone.apply_chat_template(CONVERSATIONS[1]) == ours.apply_chat_template(CONVERSATIONS[1])


def test_clean_up_tokenization_spaces(hf_dir):
    plain = Tokenizer.from_path(hf_dir({}, name="a"))
    cleaned = Tokenizer.from_path(hf_dir({"clean_up_tokenization_spaces": True}, name="b"))
    ids = plain.encode("yes , it is .")
    assert plain.decode(ids) == "yes , it is ."
    assert cleaned.decode(ids) == "yes, it is."


# -- SentencePiece -------------------------------------------------------------

def test_sentencepiece_round_trip_and_special_ids(sp_dir):
    tok = Tokenizer.from_path(sp_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == \
        (sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id()) == (1, 2, 3, 0)
    assert tok.vocab_size == 400
    for text in ["Natalia sold clips to 48 of her friends.", "How many apples did Tom eat?"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and ids[1:] == sp.encode(text)  # BOS by default, no EOS
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
        assert tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False) == ids


def test_sentencepiece_specials_in_text(sp_dir):
    tok = Tokenizer.from_path(sp_dir / "tokenizer.model")
    ids = tok.encode("How many</s> apples<pad>", add_special_tokens=False)
    assert tok.eos_token_id in ids and tok.pad_token_id in ids
    assert tok.decode(ids) == "How many apples"
    # Text segments around special tokens are encoded (and decoded) independently.
    assert tok.decode(ids, skip_special_tokens=False) == "How many</s>apples<pad>"
    assert tok.encode("How many</s>apples<pad>", add_special_tokens=False) == ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([10_000])


def test_sentencepiece_config_overrides(sp_dir, tmp_path):
    (tmp_path / "my.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "add_eos_token": True, "pad_token": None,
         "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}))
    tok = Tokenizer.from_path(tmp_path)
    ids = tok.encode("How many")
    assert ids[0] != tok.bos_token_id and ids[-1] == tok.eos_token_id
    prompt = tok.render_prompt([{"role": "user", "content": "How many"}])
    assert prompt == "<s>How many"
    assert tok.encode(prompt, add_special_tokens=False)[0] == tok.bos_token_id
    assert pickle.loads(pickle.dumps(tok)).encode("How many") == ids


# -- character tokenizer -------------------------------------------------------

def test_char_tokenizer_round_trip(char_dir):
    tok = Tokenizer.from_path(char_dir)
    assert tok.vocab_size == 16
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok.encode("042+917=0959")
    assert len(ids) == 12 and tok.decode(ids) == "042+917=0959"
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == "042+917=0959"
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=False) == "042+917=0959<eos>"
    assert tok.encode("1x") == [tok.token_to_id("1"), tok.unk_token_id]
    assert tok.encode("1<eos>") == [tok.token_to_id("1"), tok.eos_token_id]
    hf = PreTrainedTokenizerFast.from_pretrained(str(char_dir))
    assert hf.encode("042+917=") == tok.encode("042+917=")
    assert hf.eos_token_id == tok.eos_token_id and hf.pad_token_id == tok.pad_token_id


def test_char_tokenizer_whitespace_and_bos(tmp_path):
    directory = build_char_tokenizer("ab \n", tmp_path / "c", add_bos_token=True)
    tok = Tokenizer.from_path(directory)
    assert tok.decode(tok.encode("a b\nba")) == "a b\nba"
    assert tok.encode("ab")[0] == tok.bos_token_id
    assert len(tok.encode("ab", add_special_tokens=False)) == 2
    assert PreTrainedTokenizerFast.from_pretrained(str(directory)).encode("ab") == tok.encode("ab")


def test_char_tokenizer_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="distinct"):
        build_char_tokenizer("01", tmp_path, eos="<x>", pad="<x>")
    with pytest.raises(ValueError, match="at least one"):
        build_char_tokenizer("", tmp_path)
    with pytest.raises(ValueError, match="also special"):
        build_char_tokenizer("01#", tmp_path, bos="#")


# -- errors --------------------------------------------------------------------

def test_missing_path_names_path_and_expected_files(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere") as err:
        Tokenizer.from_path(missing)
    assert "tokenizer.json" in str(err.value) and "tokenizer.model" in str(err.value)
    with pytest.raises(FileNotFoundError, match="tokenizer.json, tokenizer.model") as err:
        Tokenizer.from_path(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_ambiguous_or_wrong_files(tmp_path, sp_dir):
    for name in ("a.model", "b.model"):
        (tmp_path / name).write_bytes((sp_dir / "tokenizer.model").read_bytes())
    with pytest.raises(FileNotFoundError, match="several"):
        Tokenizer.from_path(tmp_path)
    text_file = tmp_path / "vocab.txt"
    text_file.write_text("x")
    with pytest.raises(ValueError, match="vocab.txt"):
        Tokenizer.from_path(text_file)
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="bad_json"):
        Tokenizer.from_path(bad_json)
    bad_config = tmp_path / "cfg"
    bad_config.mkdir()
    (bad_config / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    (bad_config / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_path(bad_config)
