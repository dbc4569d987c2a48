"""`Decoder.forward_cached` with a `KVCache` gives the logits of a full forward pass."""
import pytest
import torch

from hybridflow.models.kv_cache import KVCache
from tests.rollout.conftest import left_padded_prompts, tiny_decoder


def _continuation(prompts, mask, steps: int, seed: int = 1):
    """Random new tokens [B, steps] and the full sequence with its mask."""
    g = torch.Generator().manual_seed(seed)
    new = torch.randint(1, 101, (prompts.shape[0], steps), generator=g)
    return new, torch.cat([prompts, new], 1), torch.cat([mask, torch.ones_like(new)], 1)


@torch.no_grad()
def test_incremental_logits_match_full_forward(family):
    """Prefill of left-padded prompts, a chunk of three tokens, then one token at a time.

    The sequences (9 + 7 tokens) are longer than the Mistral window (5), so
    windowed layers must drop the keys that slid out.
    """
    model = tiny_decoder(family)
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    new, full_ids, full_mask = _continuation(ids, mask, 7)
    ref = model(full_ids, full_mask)

    cache = KVCache(model.cfg, ids.shape[0], full_ids.shape[1])
    out = [model.forward_cached(ids, cache, mask), model.forward_cached(new[:, :3], cache)]
    out += [model.forward_cached(new[:, i:i + 1], cache) for i in range(3, 7)]
    got = torch.cat(out, 1)

    real = full_mask.bool()
    torch.testing.assert_close(got[real], ref[real], rtol=1e-5, atol=1e-5)
    assert ref[real].std() > 0.5  # not a comparison of near-constant logits
    assert cache.length == full_ids.shape[1]


@torch.no_grad()
def test_prompt_prefilled_once_for_several_rows():
    """A cache of 2B rows filled from B prompts holds each prompt twice (prompt-major)."""
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    ids2, mask2 = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    new, full_ids, full_mask = _continuation(ids2, mask2, 3)
    ref = model(full_ids, full_mask)

    cache = KVCache(model.cfg, 2 * ids.shape[0], full_ids.shape[1])
    first = model.forward_cached(ids, cache, mask, last_only=True)
    torch.testing.assert_close(first.repeat_interleave(2, 0)[:, 0], ref[:, ids.shape[1] - 1],
                               rtol=1e-5, atol=1e-5)
    for i in range(3):
        step = model.forward_cached(new[:, i:i + 1], cache)
        torch.testing.assert_close(step[:, 0], ref[:, ids.shape[1] + i], rtol=1e-5, atol=1e-5)


def test_cache_misuse_is_rejected():
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    cache = KVCache(model.cfg, 2 * ids.shape[0], ids.shape[1] + 1)
    with pytest.raises(ValueError, match="cannot append 3 rows to a cache of 8 rows"):
        cache.append(3, torch.ones(3, 3))
    with torch.no_grad():
        model.forward_cached(ids, cache, mask)
        with pytest.raises(ValueError, match="cannot append 4 rows .* holding 9 tokens"):
            cache.append(1, torch.ones(4, 1))
        model.forward_cached(torch.ones(8, 1, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="capacity 10 exceeded"):
            model.forward_cached(torch.ones(8, 1, dtype=torch.long), cache)
