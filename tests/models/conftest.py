"""Tiny random HF models built locally with `transformers` (no model hub)."""
import pytest
import torch
import transformers

# (HF model class, config class, config overrides): each exercises one switch.
FAMILIES = {
    "llama-gqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                  dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-llama3-rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                              dict(num_attention_heads=4, num_key_value_heads=4, rope_scaling={
                                  "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2-bias-tied": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
                        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral-window": (transformers.MistralForCausalLM, transformers.MistralConfig,
                       dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=5)),
    # QK-norm, and a head_dim that is not hidden / heads.
    "qwen3-qknorm": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config,
                     dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    # Experts: top-2 of 4 with renormalised weights (Qwen3-MoE), Mixtral's names, and a gated shared
    # expert with the full softmax's weights (Qwen2-MoE, which also has a QKV bias).
    "qwen3moe-top2": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                      dict(num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral-top2": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                     dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=2)),
    "qwen2moe-shared": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig,
                        dict(num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48)),
}
MOE_FAMILIES = ("qwen3moe-top2", "mixtral-top2", "qwen2moe-shared")


def build_hf_model(name: str, vocab_size: int = 103, seed: int = 0):
    """A random model whose weights (biases too) are far from HF's zero/one init. An MoE router's weights are
    larger (std 0.5), so that no token's k-th and (k+1)-th expert are near a tie that rounding could flip."""
    model_cls, config_cls, overrides = FAMILIES[name]
    cfg = config_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     rope_theta=5000.0, max_position_embeddings=128, rms_norm_eps=1e-5, **overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * (0.2 if pname.endswith("bias") else 0.08))
    return model.eval()


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture
def hf_checkpoint(family, tmp_path):
    """(HF model, directory it was saved to) for each family."""
    model = build_hf_model(family)
    model.save_pretrained(tmp_path / family)
    return model, tmp_path / family
