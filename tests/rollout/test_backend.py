"""The rollout interface without vLLM: weights by HF name in buckets, the built-in engine's load_weights,
sync_weights, the factory, and a missing or untested vLLM named clearly (the engine itself: tests/vllm/)."""
import sys

import pytest
import torch

from hybridflow.config.schema import ENGINES, RolloutConfig
from hybridflow.errors import ConfigError
from hybridflow.rollout import Generator, RolloutBackend, SamplingParams, hf_named, sync_weights
from hybridflow.rollout import factory
from hybridflow.rollout.factory import build_backend, build_with_fallback
from hybridflow.rollout.weights import buckets
from hybridflow.rollout.vllm_backend import TESTED_VLLM, cpu_kv_cache_bytes, import_vllm, untested
from tests.rollout.conftest import PAD, left_padded_prompts, tiny_decoder

GREEDY = SamplingParams(max_new_tokens=8, do_sample=False)


class _Tok:
    pad_token_id = PAD


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_builtin_generator_is_a_rollout_backend_built_by_the_factory():
    model = tiny_decoder("llama-gqa")
    backend = build_backend(RolloutConfig(), model, _Tok(), "unused")
    assert isinstance(backend, Generator) and isinstance(backend, RolloutBackend) and backend.model is model
    assert ENGINES == ("builtin", "vllm")
    with pytest.raises(ConfigError, match="rollout.engine: 'sglang' is not one of"):
        build_backend(RolloutConfig(engine="sglang"), model, _Tok(), "unused")


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias-tied"])
def test_weights_by_hf_name_in_small_buckets_refresh_a_stale_copy(family):
    """Buckets of 20 KB split q/k/v and gate/up across transfers (a larger tensor travels alone); the copy
    then generates as the source. Without the load the copy (other weights) generates something else."""
    source, stale = tiny_decoder(family, seed=0), tiny_decoder(family, seed=3)
    ids, mask = left_padded_prompts(source.cfg.vocab_size)
    want = Generator(source, PAD).generate(ids, mask, GREEDY)
    copy = Generator(stale, PAD)
    assert not torch.equal(copy.generate(ids, mask, GREEDY).responses, want.responses)

    cap = 20_000
    parts = [b for b in buckets(hf_named(source), cap)]
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= cap or len(b) == 1 for b in parts)
    where = {name: i for i, b in enumerate(parts) for name, _ in b}
    assert where["model.layers.0.self_attn.q_proj.weight"] != where["model.layers.0.self_attn.k_proj.weight"]
    taken = copy.load_weights(pair for b in parts for pair in b)
    assert taken == _bytes(source)
    for (name, got), (_, ref) in zip(stale.named_parameters(), source.named_parameters()):
        assert torch.equal(got, ref), name
    out = copy.generate(ids, mask, GREEDY)
    assert torch.equal(out.responses, want.responses) and torch.equal(out.log_probs, want.log_probs)


def test_hf_names_are_the_checkpoint_names_and_bad_ones_are_named():
    model = tiny_decoder("qwen2-bias-tied")
    named = dict(hf_named(model))
    assert "model.layers.0.self_attn.k_proj.bias" in named and "lm_head.weight" not in named  # tied
    assert named["model.layers.1.mlp.up_proj.weight"].shape == (model.cfg.intermediate_size, model.cfg.hidden_size)
    generator = Generator(tiny_decoder("qwen2-bias-tied", seed=1), PAD)
    generator.load_weights([("lm_head.weight", named["model.embed_tokens.weight"])])  # a tied copy: skipped
    with pytest.raises(KeyError, match="'model.layers.9.mlp.up_proj.weight' is not a tensor of this qwen2 model"):
        generator.load_weights([("model.layers.9.mlp.up_proj.weight", named["model.layers.1.mlp.up_proj.weight"])])
    with pytest.raises(KeyError, match=r"left incomplete: \['layers.0.attn.qkv.weight'\]"):
        generator.load_weights([("model.layers.0.self_attn.q_proj.weight",
                                 named["model.layers.0.self_attn.q_proj.weight"])])
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        next(buckets(named.items(), 0))


def test_sync_weights_moves_nothing_to_an_engine_on_the_same_model():
    source = tiny_decoder("llama-gqa")
    assert sync_weights(Generator(source, PAD), source) == {}
    other = Generator(tiny_decoder("llama-gqa", seed=5), PAD)
    metrics = sync_weights(other, source)
    assert metrics["reshard/push_bytes"] == _bytes(source) and metrics["reshard/push_time_s"] >= 0
    assert all(torch.equal(a, b) for a, b in zip(other.model.parameters(), source.parameters()))


@pytest.mark.skipif("vllm" in sys.modules, reason="checks the error where vLLM is missing")
def test_missing_vllm_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ConfigError, match=r"rollout.engine: 'vllm' needs the vLLM package.*hybridflow\[vllm\]"):
        import_vllm()
    with pytest.raises(ConfigError, match="needs the vLLM package"):
        build_backend(RolloutConfig(engine="vllm"), tiny_decoder("llama-gqa"), _Tok(), "unused")


def test_the_factory_falls_back_to_the_builtin_engine_only_where_vllm_does_not_import(monkeypatch):
    """The DataFlow API's promise, kept in the factory: a missing vLLM is a warning and a `Generator` on the
    model; any other error building the vLLM engine (here a refused layout) is raised, not hidden."""
    model = tiny_decoder("llama-gqa")
    backend, engine = build_with_fallback(RolloutConfig(), model, _Tok(), "unused")
    assert engine == "builtin" and isinstance(backend, Generator) and backend.model is model
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.warns(RuntimeWarning, match="vLLM is not installed.*needs the vLLM package.*built-in engine"):
        backend, engine = build_with_fallback(RolloutConfig(engine="vllm"), model, _Tok(), "unused")
    assert engine == "builtin" and isinstance(backend, Generator) and backend.model is model

    def refused(*args, **kwargs):
        raise ConfigError("rollout.grouping", "not a block of consecutive ranks")

    monkeypatch.setattr(factory, "VLLMBackend", refused)
    with pytest.raises(ConfigError, match="rollout.grouping"):
        build_with_fallback(RolloutConfig(engine="vllm"), model, _Tok(), "unused")


def test_versions_outside_the_tested_range_are_named():
    low, high = TESTED_VLLM
    assert untested(low) is None and untested(low + "+cpu") is None
    assert untested(high) == f"vLLM {high} is installed; hybridflow's vLLM backend is tested with >={low},<{high}"
    assert untested("0.8.5") is not None


def test_the_cpu_kv_cache_holds_two_sequences_of_the_longest_length():
    """SmolLM2's shape at its 8192 positions needs more than the 256 MiB floor (vLLM refused to start with it)."""
    from hybridflow.models import DecoderConfig

    smollm2 = DecoderConfig.from_hf_dict(dict(model_type="llama", vocab_size=49152, hidden_size=576,
                                              intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                              num_key_value_heads=3, max_position_embeddings=8192))
    per_token = 2 * 30 * 3 * 64 * 4  # keys and values, layers, kv heads, head_dim, float32
    assert cpu_kv_cache_bytes(smollm2, "float32") == 2 * 8192 * per_token
    assert cpu_kv_cache_bytes(smollm2, "bfloat16", max_model_len=512) == 256 * 2**20
