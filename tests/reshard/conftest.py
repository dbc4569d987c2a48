"""Tiny random HF checkpoints of the families the reshard tool converts."""
import pytest
import torch

from hybridflow.models import DecoderConfig
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import load_hf_state_dict, save_hf_checkpoint
from hybridflow.models.decoder import Decoder

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=37, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)
# Qwen2: QKV bias and tied embeddings; Mistral: a sliding window; Llama: untied, GQA.
FAMILIES = {
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8),
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False),
    # Qwen3: QK-norm; Qwen3-MoE: 4 experts (top 2) in every layer, each split like an MLP over TP.
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=24),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}


def write_model(path, family: str = "qwen2", dtype=torch.float32, **overrides):
    """A random model of `family` as an HF checkpoint at `path`; returns its config."""
    cfg = DecoderConfig.from_hf_dict({**BASE, **FAMILIES[family], **overrides})
    dec = Decoder(cfg).init_weights(std=0.2, seed=0).to(dtype)
    hf = get_bridge(cfg).generation_to_hf({k: v.detach() for k, v in dec.state_dict().items()})
    config = cfg.to_hf_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_hf_checkpoint(hf, config, path)
    return cfg


def assert_same_hf(a, b) -> None:
    """Two HF checkpoints hold the same tensors, bit for bit."""
    x, y = load_hf_state_dict(a), load_hf_state_dict(b)
    assert sorted(x) == sorted(y)
    for name in x:
        assert x[name].dtype == y[name].dtype and torch.equal(x[name], y[name]), name


@pytest.fixture
def qwen(tmp_path):
    write_model(tmp_path / "hf", "qwen2")
    return tmp_path / "hf"
