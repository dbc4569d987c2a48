"""Decoder architecture read from an HF `config.json` (Llama, Qwen2, Mistral).

The three families differ only in a few switches (QKV bias, sliding window,
tied embeddings, RoPE base/scaling); `DecoderConfig` holds exactly those, so
the plain decoder, the bridge and the Megatron builder read one description.
Options these families can carry but hybridflow does not implement fail
loudly here instead of giving silently wrong logits.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


# Sizes config.json must give as positive integers (a "16" would fail far from here, in arithmetic).
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")


class ModelConfigError(ValueError):
    """config.json describes a model this decoder cannot reproduce exactly."""


class UnsupportedArchitecture(ModelConfigError):
    """A well-formed config.json of an architecture (or an option of one) hybridflow's decoder does not
    reproduce: such a model runs only under `transformers` (`DecoderConfig.from_pretrained(any_architecture=
    True)` describes it)."""


@dataclass
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # Per layer: None for full attention, else the sliding-window size.
    layer_windows: list[Optional[int]] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int | list[int]] = None
    torch_dtype: str = "float32"
    # False: a model hybridflow's decoder, bridge and megatron-core builder do not reproduce (GPT-2, a Llama
    # with a GELU MLP, ...), described from its config.json for the run's planning only (`foreign`); it runs
    # under `transformers` alone (an FSDP role with fsdp.modeling: transformers, generating with
    # `rollout/hf_generate.py`). Building a decoder or a bridge from it is a ModelConfigError.
    native: bool = True
    why_foreign: str = ""  # why the decoder does not build it (the UnsupportedArchitecture message)
    hf_config: Optional[dict] = None  # a foreign model's config.json as read: its export writes it back

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_layers
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "DecoderConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise UnsupportedArchitecture(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_FAMILIES}")
        for key in _SIZE_KEYS:
            value = hf.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ModelConfigError(f"{key}={value!r}: must be a positive integer")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitecture(f"hidden_act={act!r}: only SwiGLU (silu) MLPs are supported")
        if hf.get("mlp_bias"):
            raise UnsupportedArchitecture("mlp_bias=true is not supported")
        # Llama's `attention_bias` also puts a bias on o_proj, which Megatron's
        # local spec cannot hold separately from the MLP biases; Qwen2 always
        # has a QKV bias and never an o_proj bias.
        if model_type != "qwen2" and hf.get("attention_bias"):
            raise UnsupportedArchitecture("attention_bias=true (bias on o_proj) is not supported")
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedArchitecture(f"rope_type={rope_type!r} is not supported (default, linear, llama3)")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            layer_windows=_layer_windows(hf, model_type),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        )

    @classmethod
    def foreign(cls, hf: dict[str, Any], why: str) -> "DecoderConfig":
        """A description (native=False) of a model the decoder does not build (`why`), read through
        `transformers`' own config class, whose standard names (num_hidden_layers, hidden_size, ...) cover
        the architecture's own (GPT-2's n_layer, n_embd, ...). Windows: the config's sliding_window on every
        layer, which keeps packed and prompt-shared micro-batches (a mask of hybridflow's) off it."""
        import transformers

        try:
            config = transformers.AutoConfig.for_model(**hf)
        except (ValueError, TypeError, KeyError) as exc:
            raise ModelConfigError(f"{why}, and transformers does not read this config.json either "
                                   f"({type(exc).__name__}: {exc})") from None
        heads = config.num_attention_heads
        hidden = config.hidden_size
        window = getattr(config, "sliding_window", None)
        layers = config.num_hidden_layers
        return cls(
            model_type=config.model_type, vocab_size=config.vocab_size, hidden_size=hidden,
            intermediate_size=(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                               or 4 * hidden),
            num_layers=layers, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or hidden // heads,
            max_position_embeddings=getattr(config, "max_position_embeddings", None) or 4096,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            layer_windows=[window if isinstance(window, int) else None] * layers,
            bos_token_id=getattr(config, "bos_token_id", None), eos_token_id=getattr(config, "eos_token_id", None),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            native=False, why_foreign=why, hf_config=dict(hf))

    @classmethod
    def from_pretrained(cls, path: str | Path, any_architecture: bool = False) -> "DecoderConfig":
        """The model at `path` (its directory or config.json). any_architecture: a model the decoder does not
        build (UnsupportedArchitecture) is described (`foreign`) instead of refused; malformed files are
        refused either way."""
        file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"model config not found: {file}")
        try:
            hf = json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise ModelConfigError(f"{file} is not valid JSON: {exc}") from None
        if not isinstance(hf, dict):
            raise ModelConfigError(f"{file} holds {type(hf).__name__}, not a JSON object")
        try:
            return cls.from_hf_dict(hf)
        except KeyError as exc:
            raise ModelConfigError(f"{file} lacks the key {exc.args[0]!r}") from None
        except UnsupportedArchitecture as exc:
            if not any_architecture:
                raise
            return cls.foreign(hf, str(exc))

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` an HF loader needs to rebuild this model (a foreign one's: as it was read)."""
        if not self.native:
            return dict(self.hf_config)
        out: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        windows = {w for w in self.layer_windows if w is not None}
        if self.model_type == "mistral":
            out["sliding_window"] = windows.pop() if windows else None
        if self.model_type == "qwen2":
            out["use_sliding_window"] = bool(windows)
            if windows:
                out["sliding_window"] = windows.pop()
                out["max_window_layers"] = self.layer_windows.index(out["sliding_window"])
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _layer_windows(hf: dict[str, Any], model_type: str) -> list[Optional[int]]:
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    if model_type == "mistral":
        return [window] * n
    if model_type == "qwen2" and hf.get("use_sliding_window") and window:
        first = hf.get("max_window_layers", n)
        return [window if i >= first else None for i in range(n)]
    return [None] * n
