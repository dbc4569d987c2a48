"""The rollout engine on a transformers model's own code (`rollout/hf_generate.py`): against the built-in
engine on the models both build, against `transformers`' generate on one hybridflow's decoder does not.

The two engines compute the same logits by different code, so the same keyed noise picks the same tokens
(a flip would need two tokens' perturbed scores within float rounding: not at these seeds) and the log-probs
agree within 1e-5.
"""
import pytest
import torch

from hybridflow.rollout import Generator, SamplingParams
from hybridflow.rollout.hf_generate import HFGenerator
from tests.rollout.conftest import PAD, left_padded_prompts, tiny_decoder
from tests.rollout.test_generator import STEPS, CharTokenizer, _greedy, _hf_generate


def _gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=128,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3)
    return transformers.GPT2LMHeadModel(config).eval()


def _counting_compactions(monkeypatch) -> list:
    """Each time a generate call drops ended rows from transformers' KV cache (`batch_select_indices`)."""
    from transformers import DynamicCache

    calls, select = [], DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices",
                        lambda self, keep: calls.append(len(keep)) or select(self, keep))
    return calls


def test_keyed_samples_equal_the_built_in_engines_on_every_family(family, hf_twin, monkeypatch):
    """n = 3 samples of each left-padded prompt, keyed, with stop tokens (rows end at different steps and
    the ended ones leave the batch); and greedy."""
    compactions = _counting_compactions(monkeypatch)
    model = tiny_decoder(family)
    twin = hf_twin(model)
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    keys = torch.tensor([5, 17, 29, 41])
    stops = tuple(range(3, 101, 8))  # ~1 in 8 tokens ends a row
    for params in (SamplingParams(max_new_tokens=STEPS, n=3, temperature=0.9, stop_token_ids=stops), _greedy()):
        want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=keys)
        got = HFGenerator(twin, PAD).generate(ids, mask, params, row_keys=keys)
        assert torch.equal(got.responses, want.responses) and torch.equal(got.response_mask, want.response_mask)
        assert torch.equal(got.prompts, want.prompts) and torch.equal(got.prompt_mask, want.prompt_mask)
        torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-5, rtol=0)
    assert got.responses.unique().numel() > 10  # varied text (greedy)
    assert compactions  # the sampled call dropped ended rows


def test_a_prompts_samples_do_not_depend_on_its_batch(monkeypatch):
    """Keyed sampling: a prompt generated alone (no padding) gives the tokens it gives among others, whatever
    rows ended beside it and left the batch."""
    compactions = _counting_compactions(monkeypatch)
    model = _gpt2()
    ids, mask = left_padded_prompts(101)
    params = SamplingParams(max_new_tokens=STEPS, n=2, temperature=1.0, stop_token_ids=tuple(range(1, 101, 8)))
    keys = torch.tensor([3, 4, 5, 6])
    together = HFGenerator(model, PAD).generate(ids, mask, params, row_keys=keys)
    alone = HFGenerator(model, PAD).generate(ids[1:2, -4:], mask[1:2, -4:], params, row_keys=keys[1:2])
    width = alone.responses.shape[1]  # the batch ran to its longest row; beyond this row's, padding
    assert torch.equal(alone.responses, together.responses[2:4, :width])
    assert not together.response_mask[2:4, width:].any()
    torch.testing.assert_close(alone.log_probs, together.log_probs[2:4, :width], atol=1e-5, rtol=0)
    assert compactions


def test_greedy_on_a_gpt2_matches_transformers_generate():
    """An architecture hybridflow's decoder does not build: learned positions (counted from the mask under
    left padding), LayerNorm, GELU, Conv1D layers, tied embeddings."""
    model = _gpt2()
    ids, mask = left_padded_prompts(101)
    out = HFGenerator(model, PAD).generate(ids, mask, _greedy())
    assert torch.equal(out.responses, _hf_generate(model, ids, mask))
    assert out.responses.unique().numel() > 5


def test_stop_strings_and_weights():
    model = _gpt2()
    ids, mask = left_padded_prompts(101)
    tok = CharTokenizer()
    generator = HFGenerator(model, PAD, tokenizer=tok)
    free = generator.generate(ids, mask, _greedy()).responses
    stop = tok.decode(free[0].tolist())[3:5]
    out = generator.generate(ids, mask, _greedy(stop=(stop,)))
    ends = [text.find(stop) + len(stop) if stop in text else STEPS for text in map(tok.decode, free.tolist())]
    assert out.response_mask.sum(1).tolist() == ends
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        HFGenerator(model, PAD).generate(ids, mask, _greedy(stop=("x",)))
    # load_weights: by HF name, in place; a tied checkpoint's lm_head skipped; an unknown name refused
    state = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
    taken = generator.load_weights([*state.items(), ("lm_head.weight", state["transformer.wte.weight"])])
    assert taken == sum(t.numel() * t.element_size() for t in state.values())
    assert all(torch.equal(p, state[n]) for n, p in model.named_parameters())
    with pytest.raises(KeyError, match="not a tensor of this GPT2LMHeadModel"):
        generator.load_weights([("transformer.nope", torch.zeros(1))])
