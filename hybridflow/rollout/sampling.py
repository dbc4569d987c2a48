"""Sampling parameters and the per-step choice of next tokens, batched over rows.

`sample(logits[B,V], params, generator) -> (tokens[B], log_probs[B])`. The
returned log-prob is that of the temperature-scaled distribution
`log_softmax(logits / temperature)` (plain `log_softmax(logits)` when greedy),
before top-k / top-p truncation: that is what the trainer recomputes from a
forward pass, so the two agree; truncation only restricts which tokens can
be drawn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0      # 0 => greedy
    top_p: float = 1.0
    top_k: int = -1               # -1 disabled
    do_sample: bool = True        # False => greedy
    n: int = 1                    # samples per prompt; rows are prompt-major
    stop_token_ids: tuple[int, ...] = ()  # EOS ids: the row ends with (and keeps) the token
    stop: tuple[str, ...] = ()    # stop strings (need a tokenizer): kept in the response

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


def truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`scaled` [B, V] with tokens outside the top-k / top-p nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability
    reaches `top_p` (the most likely token is always kept).
    """
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # mass before this token already enough
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def counter_uniform(keys: torch.Tensor, width: int) -> torch.Tensor:
    """Uniforms in (0, 1), [B, width]: a pure function of (keys[b], column).

    A splitmix64-style hash of a counter (int64 arithmetic wraps), so a row's
    random numbers do not depend on which other rows share its batch.
    """
    def shr(z: torch.Tensor, k: int) -> torch.Tensor:  # logical shift: torch's >> keeps the sign
        return (z >> k) & ((1 << (64 - k)) - 1)

    x = keys.long()[:, None] * width + torch.arange(width, device=keys.device)
    z = x + _GOLDEN
    z = (z ^ shr(z, 30)) * _MIX1
    z = (z ^ shr(z, 27)) * _MIX2
    z = z ^ shr(z, 31)
    mantissa = shr(z, 12)  # 52 bits: (m + 0.5) / 2^52 is exact in float64 and strictly inside (0, 1)
    return (mantissa.double() + 0.5) * 2.0 ** -52


def keyed_choice(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over `scaled` [B, V] (tempered, truncated logits) with noise hashed from keys [B].

    Eagerly that is ~20 passes over a [B, V] int64/float64 tensor, more memory traffic than a small model's
    own step at a large vocabulary; the GPU decode path compiles it into one reduction that reads the
    logits once (`static_decode.compiled_keyed_choice`)."""
    gumbel = -torch.log(-torch.log(counter_uniform(keys, scaled.shape[-1])))
    return (scaled.double() + gumbel).argmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None,
           keys: Optional[torch.Tensor] = None, choose=keyed_choice) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] from `logits` [B, V] (any float dtype).

    keys [B] (int64): draw row b's token with Gumbel-max noise hashed from
    keys[b] instead of `generator`, so each row's sample is independent of
    how rows are batched (the same prompt gives the same sample on any rank).
    `choose` is that keyed draw (`keyed_choice`, or a compiled copy of it).
    """
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
    elif keys is not None:
        logits = logits / params.temperature
        tokens = choose(truncate(logits, params.top_k, params.top_p), keys)
    else:
        logits = logits / params.temperature
        probs = truncate(logits, params.top_k, params.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    # log_softmax(logits)[tokens] without writing the whole [B, V] log-softmax.
    log_probs = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)
    return tokens, log_probs
