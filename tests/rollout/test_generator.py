"""The built-in rollout engine: parity with transformers, log-probs, stopping, n samples, seeding."""
import pytest
import torch

from hybridflow.rollout import Generator, SamplingParams
from tests.rollout.conftest import PAD, left_padded_prompts, tiny_decoder

STEPS = 12


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=STEPS, do_sample=False, **kwargs)


def _hf_generate(hf_model, ids, mask, eos=None):
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=STEPS,
                                pad_token_id=PAD, eos_token_id=eos)
    return out[:, ids.shape[1]:]


def _recomputed_log_probs(model, out, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) of each response token, from one full forward pass."""
    ids = torch.cat([out.prompts, out.responses], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1)
    with torch.no_grad():
        logits = model(ids, mask)[:, out.prompts.shape[1] - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, out.responses[..., None])[..., 0]


def test_greedy_matches_transformers_generate(family, hf_twin):
    """Left-padded prompts of lengths 9, 4, 1 and 7; GQA, QKV bias + tied embeddings, sliding window."""
    model = tiny_decoder(family)
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    out = Generator(model, PAD).generate(ids, mask, _greedy())
    assert torch.equal(out.responses, _hf_generate(hf_twin(model), ids, mask))
    assert out.responses.unique().numel() > 10  # the text is not one token repeated
    torch.testing.assert_close(out.log_probs, _recomputed_log_probs(model, out, 1.0), rtol=1e-5, atol=1e-5)


def test_eos_ends_each_row_as_transformers_does(hf_twin):
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    generator = Generator(model, PAD)
    free = generator.generate(ids, mask, _greedy()).responses
    eos = int(free[1, 3])
    out = generator.generate(ids, mask, _greedy(stop_token_ids=(eos, 1000)))

    ends = [row.index(eos) + 1 if eos in row else STEPS for row in free.tolist()]
    assert out.response_mask.sum(1).tolist() == ends
    assert out.responses.shape[1] == max(ends) and min(ends) < max(ends)
    for row, end in enumerate(ends):
        assert out.response_mask[row, :end].all() and not out.response_mask[row, end:].any()
        assert torch.equal(out.responses[row, :end], free[row, :end])  # EOS included
    assert (out.responses[out.response_mask == 0] == PAD).all()
    assert (out.log_probs[out.response_mask == 0] == 0).all()
    assert torch.equal(out.responses, _hf_generate(hf_twin(model), ids, mask, eos=eos))


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, -1), (0.7, 0.9, 20)])
def test_sampled_log_probs_match_a_full_forward(temperature, top_p, top_k):
    """Log-probs are of log_softmax(logits / temperature) (before truncation); 0 on padding."""
    model = tiny_decoder("qwen2-bias-tied")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=STEPS, temperature=temperature, top_p=top_p, top_k=top_k,
                            n=2, stop_token_ids=tuple(range(1, 12)))
    out = Generator(model, PAD).generate(ids, mask, params, torch.Generator().manual_seed(0))
    real = out.response_mask.bool()
    assert 0 < real.sum() < real.numel()  # some rows ended early
    ref = _recomputed_log_probs(model, out, temperature)
    torch.testing.assert_close(out.log_probs[real], ref[real], rtol=1e-5, atol=1e-5)
    assert (out.log_probs[~real] == 0).all()


class CharTokenizer:
    """One character per token, so where a stop string ends is easy to predict."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_end_rows_and_stay_in_the_response():
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    tok = CharTokenizer()
    generator = Generator(model, PAD, tokenizer=tok)
    free = generator.generate(ids, mask, _greedy()).responses
    texts = [tok.decode(row) for row in free.tolist()]
    stop = texts[0][3:5]
    out = generator.generate(ids, mask, _greedy(stop=(stop, "never")))

    ends = [text.find(stop) + len(stop) if stop in text else STEPS for text in texts]
    assert out.response_mask.sum(1).tolist() == ends
    for row, end in enumerate(ends):
        assert torch.equal(out.responses[row, :end], free[row, :end])
        assert tok.decode(out.responses[row, :end].tolist()).endswith(stop) or end == STEPS
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        Generator(model, PAD).generate(ids, mask, _greedy(stop=("x",)))


def test_n_samples_per_prompt_are_prompt_major():
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    generator = Generator(model, PAD)
    single = generator.generate(ids, mask, _greedy()).responses
    greedy = generator.generate(ids, mask, _greedy(n=3))
    assert torch.equal(greedy.prompts, ids.repeat_interleave(3, 0))
    assert torch.equal(greedy.prompt_mask, mask.repeat_interleave(3, 0))
    assert torch.equal(greedy.responses, single.repeat_interleave(3, 0))

    sampled = generator.generate(ids, mask, SamplingParams(STEPS, n=3), torch.Generator().manual_seed(0))
    groups = sampled.responses.view(4, 3, -1)
    assert all(not torch.equal(g[0], g[1]) for g in groups)  # samples of one prompt differ
    torch.testing.assert_close(sampled.log_probs, _recomputed_log_probs(model, sampled, 1.0),
                               rtol=1e-5, atol=1e-5)


def test_top_k_one_is_greedy():
    model = tiny_decoder("mistral-window")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    generator = Generator(model, PAD)
    greedy = generator.generate(ids, mask, _greedy())
    top1 = generator.generate(ids, mask, SamplingParams(STEPS, temperature=0.8, top_k=1),
                              torch.Generator().manual_seed(3))
    assert torch.equal(top1.responses, greedy.responses)


def test_seeded_generation_is_reproducible():
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    generator = Generator(model, PAD)
    params = SamplingParams(STEPS, temperature=0.9, top_p=0.95, n=2)
    first = generator.generate(ids, mask, params, torch.Generator().manual_seed(7))
    torch.rand(10)  # the global generator plays no part
    again = generator.generate(ids, mask, params, torch.Generator().manual_seed(7))
    other = generator.generate(ids, mask, params, torch.Generator().manual_seed(8))
    for name in ("responses", "response_mask", "log_probs"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert not torch.equal(first.responses, other.responses)


@pytest.mark.parametrize("steps", [1, 5])
def test_max_new_tokens_is_the_response_length_without_eos(steps):
    model = tiny_decoder("qwen2-bias-tied")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    out = Generator(model, PAD).generate(ids, mask, SamplingParams(steps), torch.Generator().manual_seed(0))
    assert out.responses.shape == out.response_mask.shape == out.log_probs.shape == (4, steps)
    assert out.response_mask.all() and out.responses.dtype == torch.long
    assert out.log_probs.dtype == torch.float32 and (out.log_probs < 0).all()


@pytest.mark.parametrize("decode", ["python", "cpu"])
def test_weights_are_read_at_call_time(decode):
    """The hybrid engine updates the parameters in place between rollouts; nothing is cached (neither by
    the Python loop nor by the C++ decode loop, which is handed the parameters at each call)."""
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    generator = Generator(model, PAD, decode=decode)
    before = generator.generate(ids, mask, _greedy()).responses
    other = tiny_decoder("llama-gqa", seed=5)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)
    after = generator.generate(ids, mask, _greedy()).responses
    assert torch.equal(after, Generator(other, PAD, decode="python").generate(ids, mask, _greedy()).responses)
    assert not torch.equal(before, after)


@pytest.mark.parametrize("greedy", [False, True])
def test_cpu_decode_loop_equals_the_python_loop(family, greedy):
    """The C++ decode loop (one call for every step after the prefill) gives the Python loop's tokens,
    masks and log-probs, with rows ending at uneven lengths; a model it does not run (the sliding
    window, QK-norm, experts) is decoded by the Python loop under decode="auto" and refused by name under
    decode="cpu"."""
    model = tiny_decoder(family)
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    keys = torch.tensor([5, 6, 7, 8])
    params = SamplingParams(max_new_tokens=40, n=3, temperature=0.9, do_sample=not greedy,
                            stop_token_ids=tuple(range(1, 101, 10)))
    want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=keys)
    got = Generator(model, PAD, decode="auto").generate(ids, mask, params, row_keys=keys)
    lengths = want.response_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows end unevenly: the loop drops them as they end
    assert torch.equal(got.responses, want.responses) and torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-5, rtol=0)
    declines = {"mistral-window": "full attention", "qwen3-qknorm": "without QK-norm",
                "qwen3moe-top2": "dense models"}
    if family in declines:
        with pytest.raises(ValueError, match=f"decode='cpu' cannot run this call: .*{declines[family]}"):
            Generator(model, PAD, decode="cpu").generate(ids, mask, params, row_keys=keys)
    else:
        cpu = Generator(model, PAD, decode="cpu").generate(ids, mask, params, row_keys=keys)
        assert torch.equal(cpu.responses, want.responses)
        with pytest.raises(ValueError, match="decode='cpu' cannot run this call: .*top-k or top-p"):
            Generator(model, PAD, decode="cpu").generate(ids, mask, SamplingParams(max_new_tokens=4, top_k=5),
                                                        row_keys=keys)
        with pytest.raises(ValueError, match="greedily or with row_keys"):
            Generator(model, PAD, decode="cpu").generate(ids, mask, SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias-tied"])
def test_cpu_prefill_fills_the_cache_as_forward_cached(family):
    """The C++ prefill (every prompt's real tokens in one pass, each prompt into its n cache rows) leaves what
    `forward_cached` leaves: the same last logits, key mask, token counts, and keys and values in every
    real slot of every row; padded slots stay masked. A prompt that does not end in a real token is refused."""
    from hybridflow.kernels.backend import cpu_extension
    from hybridflow.models.kv_cache import KVCache

    model = tiny_decoder(family)
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    n, capacity = 3, ids.shape[1] + 2
    want = KVCache(model.cfg, n * ids.shape[0], capacity)
    with torch.no_grad():
        logits = model.forward_cached(ids, want, mask, last_only=True)[:, -1]
    got = KVCache(model.cfg, n * ids.shape[0], capacity)
    got.k.zero_(), got.v.zero_()
    generator = Generator(model, PAD, decode="cpu")
    got_logits = generator._fused_prefill(cpu_extension(), ids, mask, got, n)
    torch.testing.assert_close(got_logits, logits, atol=1e-5, rtol=1e-5)
    assert (got.start, got.length) == (want.start, want.length)
    assert torch.equal(got.key_mask, want.key_mask) and torch.equal(got.seen, want.seen)
    real = want.key_mask[None, :, None, :, None].expand_as(want.k)  # [layers, rows, groups, slots, hd]
    torch.testing.assert_close(got.k[real], want.k[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.v[real], want.v[real], atol=1e-5, rtol=1e-5)
    assert not got.k[~real].any()  # padding was not computed
    right_padded = torch.flip(mask, [1])
    with pytest.raises(RuntimeError, match="prompt 1 does not end in a real token"):
        generator._fused_prefill(cpu_extension(), ids, right_padded, KVCache(model.cfg, n * 4, capacity), n)


def test_keyed_samples_do_not_depend_on_the_batch():
    """row_keys: a prompt's n samples are the same alone or batched with others (any rank split)."""
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    keys = torch.tensor([11, 22, 33, 44])
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.95, n=3)
    gen = Generator(model, PAD)
    whole = gen.generate(ids, mask, params, row_keys=keys)
    # Rows 2..3 alone: strip their (now unneeded) left padding to a narrower batch.
    width = int(mask[2:].sum(-1).max())
    part = gen.generate(ids[2:, -width:], mask[2:, -width:], params, row_keys=keys[2:])
    r = part.responses.shape[1]
    assert torch.equal(whole.responses[6:, :r], part.responses)
    torch.testing.assert_close(whole.log_probs[6:, :r], part.log_probs, atol=1e-5, rtol=1e-5)
    assert not torch.equal(whole.responses[6:9], whole.responses[9:12])  # different prompts, different keys
    recomputed = _recomputed_log_probs(model, whole, 0.9)
    m = whole.response_mask.bool()
    torch.testing.assert_close(recomputed[m], whole.log_probs[m], atol=1e-4, rtol=1e-4)


def test_dropping_ended_rows_changes_no_output(family, monkeypatch):
    """Rows that end are dropped from the decode batch and KV cache; the survivors decode as before."""
    import hybridflow.rollout.generator as generator_module
    from hybridflow.models.kv_cache import KVCache

    model = tiny_decoder(family)
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    keys = torch.tensor([5, 6, 7, 8])
    # Ten EOS ids out of 101: rows end at varied lengths well before max_new_tokens.
    params = SamplingParams(max_new_tokens=40, n=3, stop_token_ids=tuple(range(1, 101, 10)))
    gen = Generator(model, PAD, decode="python")  # the C++ loop drops rows its own way (tested above)
    monkeypatch.setattr(generator_module, "_COMPACT_AT", 2.0)  # never drop
    kept = gen.generate(ids, mask, params, row_keys=keys)

    batches = []
    keep_rows = KVCache.keep_rows
    monkeypatch.setattr(KVCache, "keep_rows", lambda self, rows: (batches.append(rows.numel()),
                                                                  keep_rows(self, rows)))
    monkeypatch.setattr(generator_module, "_COMPACT_AT", 0.0)  # drop ended rows at every step
    dropped = gen.generate(ids, mask, params, row_keys=keys)

    lengths = kept.response_mask.sum(1)
    assert (lengths < 40).sum() >= 9 and lengths.min() < lengths.max()  # most end early, unevenly
    assert batches[0] <= 12 and batches[-1] <= 3 and batches == sorted(batches, reverse=True)
    assert torch.equal(dropped.responses, kept.responses)
    assert torch.equal(dropped.response_mask, kept.response_mask)
    torch.testing.assert_close(dropped.log_probs, kept.log_probs, atol=1e-5, rtol=1e-5)
