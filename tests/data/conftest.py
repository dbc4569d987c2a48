"""Shared fixtures for tests/data: tiny tokenizers built locally, the GSM8K path.

Nothing is downloaded: a byte-level BPE is trained on GSM8K questions (the copy
shipped in hybridflow/assets/gsm8k), a SentencePiece model
on the same text, and the character tokenizer is written by hybridflow itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from hybridflow.data import gsm8k
from hybridflow.data.tokenizer import build_char_tokenizer

# A Qwen2-style ChatML template: default system prompt, loop controls,
# raise_exception on unknown roles, `{%-` whitespace control.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'system' and loop.first %}{%- continue %}{%- endif %}\n"
    "    {%- if message['role'] not in ['user', 'assistant', 'system'] %}"
    "{{- raise_exception('Unsupported role: ' + message['role']) }}{%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass
class DataCfg:
    """Stand-in for hybridflow.config's DataConfig (same field names)."""

    train_files: list[str]
    val_files: list[str]
    max_prompt_length: int = 512
    max_response_length: int = 64
    overlong_prompts: str = "error"
    train_batch_size: int = 4
    val_batch_size: int = 4
    shuffle: bool = True
    seed: int = 0
    apply_chat_template: bool = True


def gsm8k_questions(n: int) -> list[str]:
    return gsm8k.questions(n)


def write_hf_dir(directory: Path, tokenizer_json: Path, config: dict | None = None) -> Path:
    """A tokenizer directory: a copy of ``tokenizer_json`` plus ``config`` as tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The real GSM8K files shipped in the repository (gzipped jsonl)."""
    for split in gsm8k.SPLITS:
        gsm8k.split_file(gsm8k.GSM8K_DIR, split)
    return gsm8k.GSM8K_DIR


@pytest.fixture
def make_cfg():
    """``make_cfg(**overrides)`` -> a DataCfg."""
    return lambda **overrides: DataCfg(train_files=[], val_files=[], **overrides)


@pytest.fixture
def hf_dir(tmp_path, bpe_json):
    """``hf_dir(config, name="tok")`` -> a directory with the BPE and that tokenizer_config.json."""
    return lambda config=None, name="tok": write_hf_dir(tmp_path / name, bpe_json, config)


@pytest.fixture(scope="session")
def chatml_template() -> str:
    return CHATML_TEMPLATE


@pytest.fixture(scope="session")
def bpe_json(tmp_path_factory) -> Path:
    """tokenizer.json of a byte-level BPE (vocab 600) trained on 400 GSM8K questions."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=CHATML_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(gsm8k_questions(400), trainer=trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory, bpe_json) -> Path:
    """The BPE with a Qwen-style tokenizer_config.json (ChatML template, no BOS)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "clean_up_tokenization_spaces": False}
    return write_hf_dir(tmp_path_factory.mktemp("chatml"), bpe_json, config)


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory) -> Path:
    """A directory holding tokenizer.model: a unigram SentencePiece model, vocab 400."""
    directory = tmp_path_factory.mktemp("sp")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(gsm8k_questions(600)), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "tokenizer"), vocab_size=400,
        pad_id=3, character_coverage=1.0, minloglevel=2, num_threads=1)
    corpus.unlink()
    return directory


@pytest.fixture(scope="session")
def char_dir(tmp_path_factory) -> Path:
    """The built-in demo vocabulary: digits, '+', '=' and four specials."""
    return build_char_tokenizer("0123456789+=", tmp_path_factory.mktemp("char"))
