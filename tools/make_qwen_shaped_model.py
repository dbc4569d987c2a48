"""Write a random-weight HF checkpoint shaped exactly like Qwen2.5-0.5B-Instruct, with fewer layers if asked.

No model hub is reachable here, so the GPU-scale configs cannot load the real
weights; this checkpoint has the real model's shapes (hidden 896, 14 heads, 2
KV heads of 64, MLP 4864, vocabulary 151936, QKV bias, tied embeddings, RoPE
base 1e6), so layouts, sharding, memory and speed behave as they would on the
real model, while what it generates is noise. `--layers` keeps the first N
of the 24 layers (the configs' scale test uses 2).

The tokenizer is a byte-level BPE trained on the GSM8K questions (`--src`;
by default the copy shipped in hybridflow/assets/gsm8k) with Qwen's special tokens and ChatML template, so GSM8K
prompts tokenize the way a Qwen run's would in shape (a few hundred ids per
prompt). Its vocabulary (`--vocab`, 4096 by default) is smaller than the
model's, as a real tokenizer's may be: the remaining embedding rows exist but
are never produced.

Usage::

    python tools/make_qwen_shaped_model.py --out models/qwen2.5-0.5b-shaped --layers 2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hybridflow.data import gsm8k
from hybridflow.data.gsm8k import GSM8K_DIR

QWEN25_05B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    hidden_act="silu", bos_token_id=151643, eos_token_id=151645, use_sliding_window=False, sliding_window=None,
    torch_dtype="bfloat16")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
DEFAULT_SRC = GSM8K_DIR


def train_tokenizer(questions: list[str], vocab: int):
    """A byte-level BPE whose special tokens take Qwen's names (ids 0-2 here, not Qwen's 151643+)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(questions, trainer)
    return tok


def hf_config(layers: int, tokenizer) -> dict:
    cfg = dict(QWEN25_05B, num_hidden_layers=layers, max_window_layers=layers)
    cfg["bos_token_id"] = tokenizer.token_to_id("<|endoftext|>")
    cfg["eos_token_id"] = tokenizer.token_to_id("<|im_end|>")
    return cfg


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors at std 0.02 (norms at 1), in bfloat16."""
    from hybridflow.models import Decoder, DecoderConfig, get_bridge

    model_cfg = DecoderConfig.from_hf_dict(cfg)
    decoder = Decoder(model_cfg).init_weights(std=0.02, seed=seed)
    weights = get_bridge(model_cfg).generation_to_hf(dict(decoder.state_dict()))
    return {name: t.to(torch.bfloat16) for name, t in weights.items()}


def write(out: Path, layers: int, vocab: int, src: Path, seed: int) -> Path:
    from hybridflow.models.checkpoint import save_hf_checkpoint

    questions = gsm8k.questions(directory=src)
    tokenizer = train_tokenizer(questions, vocab)
    cfg = hf_config(layers, tokenizer)
    save_hf_checkpoint(random_weights(cfg, seed), cfg, out)  # replaces `out` whole, so the tokenizer comes after
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHATML, "model_max_length": 32768}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=24, help="keep this many of the 24 layers")
    parser.add_argument("--vocab", type=int, default=4096, help="the tokenizer's vocabulary (model: 151936)")
    parser.add_argument("--src", type=Path, default=DEFAULT_SRC, help="GSM8K jsonl directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.layers <= 24:
        parser.error(f"--layers must be in 1..24, got {args.layers}")
    try:
        gsm8k.split_file(args.src, "train")
    except FileNotFoundError as exc:
        parser.error(str(exc))
    print(write(args.out, args.layers, args.vocab, args.src, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
