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


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] from `logits` [B, V] (any float dtype)."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
    else:
        logits = logits / params.temperature
        probs = truncate(logits, params.top_k, params.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    # log_softmax(logits)[tokens] without writing the whole [B, V] log-softmax.
    log_probs = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)
    return tokens, log_probs
