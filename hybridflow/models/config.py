"""Decoder architecture read from an HF `config.json`: Llama, Qwen2, Mistral, Qwen3 and the
mixture-of-experts families Qwen3-MoE, Mixtral and Qwen2-MoE.

The families differ only in a few switches (QKV bias, QK-norm, sliding window,
tied embeddings, RoPE base/scaling, experts in place of the MLP); `DecoderConfig`
holds exactly those, so the plain decoder, the bridge and the Megatron builder
read one description. Options these families can carry but hybridflow does not
implement fail loudly here instead of giving silently wrong logits.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM"}
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")  # a bias on q, k and v, never on o_proj
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")  # RMSNorm on each head's queries and keys before RoPE
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


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
    qk_norm: bool = False
    # Mixture of experts (num_experts > 0): every layer's MLP is `num_experts` SwiGLU experts of
    # `moe_intermediate_size` features, `moe_top_k` per token, chosen by a softmax router (top-k weights
    # renormalised when `moe_norm_topk_prob`); plus, when `shared_expert_intermediate_size` > 0, one
    # always-on expert, scaled by a sigmoid gate when `shared_expert_gate`.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    moe_norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_aux_loss_coef: float = 0.0  # the checkpoint's own coefficient (informational)
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
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_splits(self) -> list[tuple[str, int]]:
        """(what, features) of each MLP a tensor-parallel split must divide: the dense MLP's, or every
        expert's and the shared expert's."""
        if not self.is_moe:
            return [("MLP features", self.intermediate_size)]
        return [("expert MLP features", self.moe_intermediate_size)] + (
            [("shared-expert MLP features", self.shared_expert_intermediate_size)]
            if self.shared_expert_intermediate_size else [])

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
        if model_type not in QKV_BIAS_FAMILIES and hf.get("attention_bias"):
            raise UnsupportedArchitecture("attention_bias=true (bias on o_proj) is not supported")
        if model_type == "qwen2_moe" and hf.get("qkv_bias") is False:
            raise UnsupportedArchitecture("qkv_bias=false is not supported for qwen2_moe")
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
            qkv_bias=model_type in QKV_BIAS_FAMILIES,
            qk_norm=model_type in QK_NORM_FAMILIES,
            layer_windows=_layer_windows(hf, model_type),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            **(_moe_fields(hf, model_type) if model_type in MOE_FAMILIES else {}),
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
        if self.is_moe:
            out.update(_moe_hf_fields(self))
        windows = {w for w in self.layer_windows if w is not None}
        if self.model_type in ("mistral", "mixtral"):
            out["sliding_window"] = windows.pop() if windows else None
        if self.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
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
    if model_type in ("mistral", "mixtral"):
        return [window] * n
    if model_type != "llama" and hf.get("use_sliding_window") and window:
        first = hf.get("max_window_layers", n)
        return [window if i >= first else None for i in range(n)]
    return [None] * n


def _moe_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The expert fields of an MoE family's config.json; what the decoder does not build is refused by name."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    top_k = hf.get("num_experts_per_tok")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelConfigError(f"{key}={value!r}: must be a positive integer")
    if top_k > experts:
        raise ModelConfigError(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    if model_type == "mixtral":
        if hf.get("router_jitter_noise"):
            raise UnsupportedArchitecture(f"router_jitter_noise={hf['router_jitter_noise']!r}: only 0 is built")
        ffn, norm, shared = hf["intermediate_size"], True, 0
    else:
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise UnsupportedArchitecture("decoder_sparse_step != 1 or mlp_only_layers (dense layers among the "
                                          "expert layers) is not supported: every layer must be an MoE layer")
        ffn, norm = hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", False))
        shared = hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return dict(num_experts=experts, moe_top_k=top_k, moe_intermediate_size=ffn, moe_norm_topk_prob=norm,
                shared_expert_intermediate_size=shared or 0, shared_expert_gate=bool(shared),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))


def _moe_hf_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """Inverse of `_moe_fields`: the config.json keys of cfg's family."""
    out: dict[str, Any] = {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.router_aux_loss_coef}
    if cfg.model_type == "mixtral":
        return {**out, "num_local_experts": cfg.num_experts, "router_jitter_noise": 0.0}
    out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
               norm_topk_prob=cfg.moe_norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    if cfg.model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=True)
    return out
