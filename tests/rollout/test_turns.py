"""KV reuse across agent turns (rollout/turns.py): the trajectories equal the re-prefilling path's token for
token (keyed sampling), their log-probs to float rounding, while each turn prefills only the new tokens."""
from __future__ import annotations

import json

import pytest
import torch

from hybridflow.data.tokenizer import Tokenizer, build_char_tokenizer
from hybridflow.envs import Environment
from hybridflow.models.kv_cache import KVCache
from hybridflow.rollout import Generator, SamplingParams
from hybridflow.rollout.agent import AgentLimits, AgentLoop
from hybridflow.rollout.turns import TurnCache
from tests.rollout.conftest import tiny_decoder

# The assistant turn ends on EOS; a tool turn is "tool:...\n", then the next assistant header.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["what is 12+34", "add 5 and 7 please", "hi"]
KEYS = torch.tensor([11, 22, 33])
# The two paths compute the same function in a different order (a turn's tokens fed one decode step at a
# time and read from the cache, against all of them in one re-prefill pass): float32 rounding, measured
# below 3e-6 on these models.
LOG_PROB_TOL = 2e-5


class Counting(Environment):
    """Observations of varying length (so the new tokens of a turn are left-padded); done after 4 turns."""

    def reset(self, prompt, ground_truth=None, extra_info=None):
        self.k = 0

    def step(self, model_turn):
        self.k += 1
        return "result " + "9" * (3 * self.k + len(model_turn) % 4), float(self.k >= 4), self.k >= 4


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789:=+ \n", tmp_path_factory.mktemp("tok"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return Tokenizer.from_path(out)


def run(tok, model, reuse: bool, decode: str, n: int = 2, temperature: float = 1.0):
    gen = Generator(model, pad_token_id=tok.pad_token_id, tokenizer=tok, decode=decode)
    # Every 6th id ends a turn: turns of different lengths, so rows end at different decode steps.
    stops = tuple(range(4, tok.vocab_size, 6)) + (tok.eos_token_id,)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, n=n, stop_token_ids=stops)
    loop = AgentLoop(gen, tok, Counting, AgentLimits(max_turns=4, max_turn_tokens=12, max_total_tokens=200),
                     reuse_cache=reuse)
    prompts = [tok.encode(tok.render_prompt([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    return prompts, loop, loop.run(prompts, KEYS, params, [{"prompt": p} for p in PROMPTS])


@pytest.mark.parametrize("decode", ["auto", "python"])  # the C++ decode loop on the CPU, and the torch one
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias-tied"])
def test_kept_cache_gives_the_re_prefill_tokens_and_log_probs(tok, decode, family):
    model = tiny_decoder(family, vocab_size=tok.vocab_size)
    prompts, again_loop, again = run(tok, model, reuse=False, decode=decode)
    _, kept_loop, kept = run(tok, model, reuse=True, decode=decode)
    assert kept_loop.reuse_cache and not again_loop.reuse_cache
    turns = [t.turns for t in again.trajectories]
    assert max(turns) == 4 and min(turns) < 4  # some run every turn, some end early: rows leave the cache
    for a, b in zip(again.trajectories, kept.trajectories):
        assert a.ids == b.ids and a.mask == b.mask and a.turns == b.turns and a.ended == b.ended
        torch.testing.assert_close(torch.tensor(b.log_probs), torch.tensor(a.log_probs), rtol=0, atol=LOG_PROB_TOL)

    # What each prefilled: re-prefill, every prompt once and then each live trajectory whole at each later
    # turn; kept, every prompt once and then per later turn the token sampled last plus the glue and
    # observation (the trajectory's non-model tokens), nothing twice.
    n = 2
    prompt_tokens = sum(len(p) for p in prompts)
    live_before = [sum(len(prompts[i // n]) + len(_ids_before_turn(t, k)) for i, t in enumerate(again.trajectories)
                       if t.turns > k) for k in range(1, 4)]
    assert again.prefill_tokens == prompt_tokens + sum(live_before)
    assert kept.prefill_tokens == prompt_tokens + sum((len(t.mask) - sum(t.mask)) + t.turns - 1
                                                      for t in kept.trajectories)
    assert kept.prefill_tokens < 0.5 * again.prefill_tokens


def _ids_before_turn(t, k: int) -> list[int]:
    """The trajectory's ids before its model turn k (0-based): up to the k-th start of a model span."""
    starts = [j for j, m in enumerate(t.mask) if m and (j == 0 or not t.mask[j - 1])]
    return t.ids[:starts[k]]


def test_greedy_turns_are_the_same_too(tok):
    model = tiny_decoder("llama-gqa", vocab_size=tok.vocab_size)
    _, _, again = run(tok, model, reuse=False, decode="auto", n=1, temperature=0.0)
    _, _, kept = run(tok, model, reuse=True, decode="auto", n=1, temperature=0.0)
    assert [t.ids for t in again.trajectories] == [t.ids for t in kept.trajectories]
    assert any(t.turns > 1 for t in kept.trajectories)


def test_sliding_window_models_and_other_engines_re_prefill(tok):
    window = Generator(tiny_decoder("mistral-window", vocab_size=tok.vocab_size), pad_token_id=tok.pad_token_id)
    assert not TurnCache.applies(window) and not TurnCache.applies(object())
    assert TurnCache.applies(Generator(tiny_decoder("llama-gqa", vocab_size=tok.vocab_size), tok.pad_token_id))


def test_a_sequence_that_does_not_extend_the_cached_ids_is_refused(tok):
    gen = Generator(tiny_decoder("llama-gqa", vocab_size=tok.vocab_size), pad_token_id=tok.pad_token_id)
    turns = TurnCache(gen)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, n=1)
    prompt = tok.encode("user:hi\nassistant:", add_special_tokens=False)
    turns.first([prompt], params, torch.tensor([5]))
    changed = [prompt[0] + 1] + prompt[1:] + [7, 8]
    with pytest.raises(ValueError, match="trajectory 0: the sequence does not extend the"):
        turns.next([0], [changed], params, torch.tensor([6]))


def test_forget_unmasks_the_slots_after_what_each_row_was_fed():
    model = tiny_decoder("llama-gqa")
    cache = KVCache(model.cfg, 2, 10)
    model.forward_cached(torch.tensor([[0, 5, 6], [4, 5, 6]]), cache, torch.tensor([[0, 1, 1], [1, 1, 1]]))
    for token in (7, 8, 9):  # three decode steps fed to both rows
        model.forward_cached(torch.tensor([[token], [token]]), cache)
    cache.forget(3, torch.tensor([1, 3]))  # row 0 was really fed one of them, row 1 all three
    assert cache.key_mask[:, :6].tolist() == [[False, True, True, True, False, False], [True] * 6]
    assert cache.seen.tolist() == [3, 6]
    picked = cache.select(torch.tensor([1]), 12)
    assert picked.capacity == 12 and picked.k.is_contiguous() and picked.seen.tolist() == [6]
    assert torch.equal(picked.k[:, 0, :, :6], cache.k[:, 1, :, :6])
    # A slot no token was written to (the C++ loop feeds no ended row) may hold NaN; a masked NaN would
    # still poison attention (0 * NaN), so select zeroes every masked slot it copies.
    cache.k[:, 0, :, 4:6] = float("nan")
    cache.v[:, 0, :, 0] = float("nan")  # the left-padding slot
    picked = cache.select(torch.tensor([0]), 12)
    assert torch.isfinite(picked.k[:, :, :, :6]).all() and torch.isfinite(picked.v[:, :, :, :6]).all()
    assert torch.equal(picked.k[:, 0, :, 1:4], cache.k[:, 0, :, 1:4])
