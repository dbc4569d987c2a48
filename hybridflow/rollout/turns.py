"""A batch of trajectories' KV cache kept between an agent's turns, on the built-in engine.

    turns = TurnCache(generator)
    out = turns.first(prompt_ids, params, row_keys)             # turn 0: the prompts, n rows each
    out = turns.next(live, [prompt + trajectory for ...], params, keys)   # turn k: only the new tokens

`next` takes the whole sequences, as a re-prefilling `generate` call would,
and prefills only what its cache does not hold yet: the token each row
sampled last (a sampled token is fed only when the next one is drawn), the
chat template's glue and the tool's observation. The cached ids are checked
against the sequences handed in, so a trajectory that changed earlier tokens
is an error, not a silent mismatch. Rows that ended leave the cache when the
next turn starts (`KVCache.select`, which also grows the capacity).

What is computed differs from a re-prefill only in order: a turn's tokens
were fed one decode step at a time and the new tokens attend to them from the
cache, where a re-prefill computes them all again in one pass, so logits
agree to float rounding and keyed samples are the same tokens unless two
logits tie within rounding (tests/rollout/test_turns.py checks both).

Not for sliding-window models: a row's real tokens have holes in the cache
(slots where an ended row was fed padding, and the left padding of each
turn's new tokens), and the window is a slice of slots (`applies` says no;
the agent loop re-prefills there). vLLM is not served here: it keeps its own
prefix cache across requests (docs/architecture.md, multi-turn rollouts).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from hybridflow.data.prompts import left_pad
from hybridflow.models.kv_cache import KVCache
from hybridflow.rollout.generator import GenerationOutput, Generator, generation_output, row_streams
from hybridflow.rollout.sampling import SamplingParams

__all__ = ["TurnCache"]


class TurnCache:
    """The cache of one `AgentLoop.run`: cache row j holds trajectory `rows[j]`, whose first `len(ids[i])`
    ids (prompt and trajectory) are in it."""

    def __init__(self, generator: Generator):
        self.gen = generator
        self.cache: Optional[KVCache] = None
        self.rows: list[int] = []
        self.ids: dict[int, list[int]] = {}

    @staticmethod
    def applies(backend) -> bool:
        """Whether `backend` is a built-in generator whose model this cache computes exactly (full attention)."""
        return isinstance(backend, Generator) and all(w is None for w in backend.model.cfg.layer_windows)

    @torch.no_grad()
    def first(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
              row_keys: torch.Tensor) -> GenerationOutput:
        """Turn 0: each prompt prefilled once into its params.n rows (trajectories i*n .. i*n + n-1), then
        decoded as `Generator.generate` does, the cache kept."""
        gen, n, steps = self.gen, params.n, params.max_new_tokens
        ids, mask = left_pad([list(p) for p in prompt_ids], gen.pad_token_id)
        device = gen.model.embed.weight.device
        fused = gen._decode_extension(params, True, device)
        ids, mask = ids.to(device), mask.to(device)
        cache = KVCache(gen.model.cfg, len(prompt_ids) * n, ids.shape[1] + steps, gen.model.embed.weight.dtype,
                        device)
        logits = gen.prefill(fused, ids, mask, cache, n)
        out = self._decode(fused, logits, cache, params, row_streams(row_keys, n, steps, device), ids.shape[1])
        self.rows = list(range(len(prompt_ids) * n))
        self.ids = {i: list(prompt_ids[i // n]) for i in self.rows}
        self._note_fed(out)
        return generation_output(ids, mask, n, torch.device("cpu"), *out)

    @torch.no_grad()
    def next(self, rows: Sequence[int], sequences: Sequence[Sequence[int]], params: SamplingParams,
             row_keys: torch.Tensor) -> GenerationOutput:
        """A later turn for trajectories `rows` (params.n = 1): sequences[j] is row j's prompt and trajectory so
        far, of which only the part after the cached ids is prefilled; row_keys [len(rows)] as for `generate`."""
        if params.n != 1:
            raise ValueError(f"a later turn samples one continuation per trajectory, got n={params.n}")
        gen, steps, device = self.gen, params.max_new_tokens, self.cache.k.device
        new = []
        for i, seq in zip(rows, sequences):
            cached = self.ids[i]
            if list(seq[:len(cached)]) != cached or len(seq) <= len(cached):
                raise ValueError(f"trajectory {i}: the sequence does not extend the {len(cached)} ids in its cache")
            new.append(list(seq[len(cached):]))
        ids, mask = left_pad(new, gen.pad_token_id)
        where = {r: j for j, r in enumerate(self.rows)}
        keep = torch.tensor([where[i] for i in rows], dtype=torch.long, device=device)
        self.cache = cache = self.cache.select(keep, self.cache.length + ids.shape[1] + steps)
        self.rows = list(rows)
        for i, extra in zip(rows, new):
            self.ids[i] += extra
        fused = gen._decode_extension(params, True, device)
        logits = gen.prefill(fused, ids.to(device), mask.to(device), cache)
        out = self._decode(fused, logits, cache, params, row_streams(row_keys, 1, steps, device), cache.length)
        self._note_fed(out)
        return generation_output(ids, mask, 1, torch.device("cpu"), *out)

    def _decode(self, fused, logits, cache: KVCache, params: SamplingParams, keys, since: int):
        """The decode steps with every row kept in the cache; then each row's slots beyond the tokens it was
        really fed (all it sampled but the last) are forgotten."""
        tokens, log_probs, mask, length = self.gen.decode_after(fused, logits, cache, params, None, keys,
                                                                compact=False)
        self.cache = cache
        cache.forget(since, mask[:, :length].sum(-1) - 1)
        return tokens, log_probs, mask, length

    def _note_fed(self, out) -> None:
        tokens, _, mask, length = out
        for j, (row, kept) in enumerate(zip(tokens[:, :length].tolist(), mask[:, :length].sum(-1).tolist())):
            self.ids[self.rows[j]] += row[:kept - 1]
