"""Turn a llama-family GGUF file into an ordinary HF directory.

A GGUF file (llama.cpp's format) holds the weights, quantized or not, the
architecture and the whole tokenizer: vocabulary, merges, special tokens and
chat template. This module reads it with the ``gguf`` package (the ``gguf``
extra), de-quantizes every tensor to float32 and writes what the rest of
hybridflow, and transformers, load: ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.

Two things llama.cpp changed on the way in are undone here:

* the Q and K projections were permuted (rotary halves interleaved) by
  llama.cpp's converter; :func:`_unpermute` puts them back in HF order;
* the tokenizer's pre-tokenizer is a name (``tokenizer.ggml.pre``); the
  names supported here are rebuilt as the ``tokenizers`` pipeline they stand
  for. Any other name is refused rather than guessed.

Only what this project's models can hold is accepted: the ``llama``
architecture with a byte-level BPE (``gpt2``) vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["GGUFError", "convert_gguf", "read_gguf"]


class GGUFError(ValueError):
    """The GGUF file is not one this converter can turn into an HF directory."""


# pre-tokenizer name -> split digits one by one before the byte-level regex
# (llama.cpp: SmolLM and StarCoder split every digit; GPT-2 does not).
_PRE_TOKENIZERS = {"smollm": True, "starcoder": True, "gpt-2": False, "default": False}
_CONTROL = 3  # llama.cpp token type of special tokens
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading a GGUF file needs the `gguf` package: pip install -e '.[gguf]'") from None
    return gguf


def _field(reader: Any, key: str, default: Any = KeyError) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise GGUFError(f"the GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _short_float(value: float) -> float:
    # GGUF stores float32; 1e-5 comes back as 9.999999747378752e-06. Write the
    # shortest decimal that rounds to the same float32, as the HF config had it.
    return float(str(np.float32(value)))


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: (heads, 2, d/2) rows were stored as (heads, d/2, 2)."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise GGUFError(f"tensor {name!r} has no Llama counterpart")


def _hf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"general.architecture is {arch!r}; only 'llama' GGUF files can be converted")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    special = {
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens.data))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": _short_float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _short_float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        **{k: int(v) for k, v in special.items() if v is not None},
    }


def _state_dict(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    gguf = _import_gguf()
    out = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape([int(n) for n in reversed(tensor.shape)])  # GGUF lists dims fastest first
        if name.endswith("q_proj.weight"):
            array = _unpermute(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = _unpermute(array, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(array, order="C"))  # a writable copy
    return out


def _tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """(a ``tokenizers.Tokenizer``, the tokenizer_config.json contents)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
                        f"(byte-level BPE 'gpt2' with one of {sorted(_PRE_TOKENIZERS)})")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, token_type in zip(tokens, types) if token_type == _CONTROL])

    def name(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}", None)
        return None if index is None else tokens[int(index)]

    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"), "unk_token": name("unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length")),
    }
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        settings["chat_template"] = template
    return tok, {k: v for k, v in settings.items() if v is not None}


def read_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``, with a clear error when it is missing or not GGUF."""
    gguf = _import_gguf()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from None


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write ``out_dir`` as an HF Llama directory (float32 safetensors); return its config."""
    from safetensors.torch import save_file

    reader = read_gguf(gguf_path)
    config = _hf_config(reader)
    tokenizer, settings = _tokenizer(reader)
    weights = _state_dict(reader, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config
