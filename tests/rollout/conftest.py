"""Tiny random decoders for the rollout tests, and the same weights loaded by `transformers`."""
import pytest
import torch

from hybridflow.models import Decoder, DecoderConfig, save_decoder

PAD = 0
# One switch each: grouped-query attention; QKV bias + tied embeddings + a
# single kv head; a sliding window shorter than the sequences; QK-norm with a
# head_dim other than hidden / heads; experts (top-2 of 4).
FAMILIES = {
    "llama-gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "qwen2-bias-tied": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=1,
                            tie_word_embeddings=True),
    "mistral-window": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=2,
                           head_dim=8, sliding_window=5),
    "qwen3-qknorm": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    "qwen3moe-top2": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}


def tiny_decoder(family: str, seed: int = 0, vocab_size: int = 101) -> Decoder:
    """A 2-layer decoder of `family` (FAMILIES) with roughened weights (`rough_decoder`)."""
    return rough_decoder(dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        rope_theta=5000.0, max_position_embeddings=128, rms_norm_eps=1e-5, **FAMILIES[family]), seed)


def rough_decoder(hf_config: dict, seed: int = 0) -> Decoder:
    """The decoder of an HF config dict, with weights large enough (std 0.15, random biases and norm
    gains) for varied greedy text."""
    model = Decoder(DecoderConfig.from_hf_dict(hf_config)).init_weights(std=0.15, seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def left_padded_prompts(vocab_size: int, lengths=(9, 4, 1, 7), seed: int = 0):
    """input_ids, attention_mask [len(lengths), max(lengths)]: left-padded with PAD, no PAD inside."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    mask = (torch.arange(t)[None] >= t - torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, vocab_size, (len(lengths), t), generator=g) * mask
    return ids, mask


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture
def hf_twin(tmp_path):
    """`hf_twin(decoder)`: the decoder's weights loaded by transformers from an HF checkpoint."""
    import transformers

    def load(model: Decoder):
        path = save_decoder(model, tmp_path / model.cfg.model_type)
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return load
