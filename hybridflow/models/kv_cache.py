"""Preallocated key/value cache for incremental decoding with `Decoder.forward_cached`.

One cache holds every layer, allocated once for a whole generation call:
keys and values are `[layers, B, kv_heads, capacity, head_dim]`. All rows
share one write position (`length`): prompts are left-padded, so each row's
real tokens occupy a contiguous run of slots ending at `length - 1`, and
`key_mask` marks the padded slots that must not be attended to. With that,
slot distance equals token distance and a sliding window is a slice of the
last `window` slots.

Simplifications: no paging and no per-row lengths; rows that have finished
are dropped in bulk by `keep_rows` (one in-place copy of the filled
slots), not slot by slot. Only the first append may be shared by several rows (one prompt
prefilled once for its `n` samples). Only activations are cached, never
weights.

Kept across an agent's turns (`rollout/turns.py`), a row's real tokens need
not be contiguous: `forget` unmasks the slots a finished row was fed padding
into, and the next turn's tokens are appended left-padded after the longest
row. Positions still count real tokens (`seen`), so a row computes what it
would on its tokens alone; only the sliding window, which is a slice of
slots, would be wrong there (such models re-prefill instead). `select`
copies the rows still running into a new, contiguous cache of a given
capacity (the C++ decode loop needs contiguous storage).
"""
from __future__ import annotations

from typing import Optional

import torch

from hybridflow.models.config import DecoderConfig


class KVCache:
    def __init__(self, cfg: DecoderConfig, batch: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.seen = torch.zeros(batch, dtype=torch.long, device=device)  # real tokens so far, per row
        self.windows = list(cfg.layer_windows)
        self.batch, self.capacity = batch, capacity
        self.start = self.length = 0  # slots of the last append: [start, length)

    def append(self, num_tokens: int, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Reserve slots for `num_tokens` new tokens; returns their position ids [b, num_tokens].

        `attention_mask` [b, num_tokens] marks left padding (default: all real,
        b = batch). `b` is the cache batch, or (first append only) a divisor
        of it: row i then fills cache rows i*r .. i*r + r-1 (prompt-major,
        r = batch // b).
        """
        if self.length + num_tokens > self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded ({self.length} + {num_tokens} tokens)")
        b = self.batch if attention_mask is None else attention_mask.shape[0]
        rows = self.batch // b  # > 1: one prompt shared by several rows
        if rows * b != self.batch or (rows > 1 and self.length):
            raise ValueError(f"cannot append {b} rows to a cache of {self.batch} rows "
                             f"holding {self.length} tokens")
        self.start, self.length = self.length, self.length + num_tokens
        if attention_mask is None:  # the per-step decode case, kept to a few ops
            positions = self.seen[:, None] + torch.arange(num_tokens, device=self.seen.device)
            self.key_mask[:, self.start:self.length] = True
            self.seen += num_tokens
            return positions
        mask = attention_mask.bool()
        positions = (self.seen[::rows, None] + mask.long().cumsum(-1) - 1).clamp(min=0)
        self.key_mask[:, self.start:self.length] = mask.repeat_interleave(rows, 0)
        self.seen += mask.sum(-1).repeat_interleave(rows)
        return positions

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only cache rows `rows` [b'] (increasing int64 indices): they move to the front.

        In place, one layer and only the filled slots at a time, so the copy
        costs what is cached and memory never grows; the cache's storage
        stays allocated until the call ends.
        """
        n, e = rows.numel(), self.length
        for cache in (self.k, self.v):
            for layer in range(cache.shape[0]):
                cache[layer, :n, :, :e] = cache[layer, rows, :, :e]  # the gather copies before the write
        self.k, self.v = self.k[:, :n], self.v[:, :n]
        self.key_mask = self.key_mask.index_select(0, rows)
        self.seen = self.seen.index_select(0, rows)
        self.batch = n

    def select(self, rows: torch.Tensor, capacity: int) -> "KVCache":
        """A new cache holding rows `rows` [b'] (int64) of this one, their filled slots copied, with room
        for `capacity` slots; contiguous, as a freshly built cache."""
        capacity = max(capacity, self.length)
        out = KVCache.__new__(KVCache)
        shape = (self.k.shape[0], rows.numel(), self.k.shape[2], capacity, self.k.shape[4])
        out.k = self.k.new_empty(shape)
        out.v = self.v.new_empty(shape)
        e = self.length
        out.key_mask = torch.zeros(rows.numel(), capacity, dtype=torch.bool, device=self.key_mask.device)
        out.key_mask[:, :e] = self.key_mask[rows, :e]
        # Slots no token was written to (the C++ decode loop feeds no ended row) hold whatever the allocator
        # left; masked, they get no attention weight, but 0 * NaN is NaN in the attention's product with V.
        written = out.key_mask[:, None, :e, None]
        for src, dst in ((self.k, out.k), (self.v, out.v)):
            for layer in range(src.shape[0]):
                dst[layer, :, :, :e] = torch.where(written, src[layer, rows, :, :e], 0.0)
        out.seen = self.seen.index_select(0, rows)
        out.windows, out.batch, out.capacity = list(self.windows), rows.numel(), capacity
        out.start, out.length = self.start, self.length
        return out

    def forget(self, since: int, kept: torch.Tensor) -> None:
        """Row r keeps only the first kept[r] [B] slots written since slot `since`: the later ones (a finished
        row's padding, a token it sampled last and was fed) are masked out and no longer counted in `seen`."""
        slots = torch.arange(self.capacity, device=self.key_mask.device)
        drop = (slots[None] >= since + kept.to(slots.device)[:, None]) & (slots[None] < self.length)
        self.seen -= (self.key_mask & drop).sum(-1)
        self.key_mask &= ~drop

    def first_key(self, window: Optional[int]) -> int:
        """First slot a query of the last append can attend to."""
        return 0 if window is None else max(0, self.start - window + 1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store keys/values [b, kv_heads, t, head_dim] of the last append; return those to attend to.

        On the first append these are `k, v` themselves (which may have fewer
        rows than the cache); afterwards, the cached slots from `first_key`.
        """
        s, e = self.start, self.length
        if k.shape[0] == self.batch:
            self.k[layer].narrow(2, s, e - s).copy_(k)
            self.v[layer].narrow(2, s, e - s).copy_(v)
        else:  # one prompt's keys into each of its rows
            self.k[layer, :, :, s:e].view(k.shape[0], -1, *k.shape[1:]).copy_(k[:, None])
            self.v[layer, :, :, s:e].view(v.shape[0], -1, *v.shape[1:]).copy_(v[:, None])
        if s == 0:
            return k, v
        lo = self.first_key(self.windows[layer])
        return self.k[layer, :, :, lo:e], self.v[layer, :, :, lo:e]

    def attention_mask(self, window: Optional[int]) -> torch.Tensor:
        """Boolean [B, 1, t, length - first_key] mask of the last append's queries over cached keys.

        Causal, key padding and sliding window, as `build_attention_mask`; a
        query always sees itself, so a padded one gives no NaN.
        """
        device = self.key_mask.device
        lo = self.first_key(window)
        q = torch.arange(self.start, self.length, device=device)[:, None]
        k = torch.arange(lo, self.length, device=device)[None]
        allowed = k <= q
        if window is not None:
            allowed &= q - k < window
        allowed = (allowed[None] & self.key_mask[:, None, lo:self.length]) | (k == q)[None]
        return allowed[:, None]
