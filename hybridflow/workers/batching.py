"""Splitting RL batches into mini- and micro-batches, and response-token views of model outputs.

A training batch holds INPUT_IDS / ATTENTION_MASK [B, T + R] (prompt then
response) and RESPONSES / RESPONSE_MASK [B, R] plus per-token fields [B, R].
The model output at column `T - 1 + j` predicts response token `j`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.data import fields as F


def tensor_fields(batch: dict[str, Any]) -> dict[str, Tensor]:
    return {k: v for k, v in batch.items() if isinstance(v, Tensor)}


def split(batch: dict[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    """Consecutive chunks of `size` rows (the last may be shorter)."""
    n = len(batch[F.INPUT_IDS])
    if size <= 0:
        raise ValueError(f"batch size must be positive, got {size}")
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, n, size)]


def shuffled(batch: dict[str, Tensor], generator: Optional[torch.Generator]) -> dict[str, Tensor]:
    n = len(batch[F.INPUT_IDS])
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    return {k: v[order] for k, v in batch.items()}


def response_slice(output: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """Model outputs [B, T+R, ...] -> the R columns that predict the response tokens."""
    r = batch[F.RESPONSES].shape[1]
    s = output.shape[1]
    return output[:, s - r - 1: s - 1]


def global_count(mask: Tensor, mode: str, group=None) -> Tensor:
    """What `aggregate_loss` divides by for the whole (data-parallel) mini-batch."""
    m = mask.bool()
    count = m.sum() if mode == "token-mean" else m.any(-1).sum()
    count = count.to(torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count


def summed_share(reports: list[dict[str, Any]], key: str, group=None) -> float:
    """A loss reported as shares of the global mini-batch loss: summed over micro-batches and DP ranks."""
    total = torch.tensor(sum(r[key] for r in reports), dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.item()


def mean_metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Average each float metric over micro-batches."""
    out: dict[str, list[float]] = {}
    for report in reports:
        for k, v in report.items():
            if isinstance(v, (int, float)):
                out.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in out.items()}


def response_log_probs(output: Tensor, batch: dict[str, Tensor], engine, temperature: float = 1.0,
                       backend: str = "auto") -> tuple[Tensor, Tensor]:
    """log p(response token) and entropy [B, R] from the engine's (vocab-sharded) logits.

    Megatron pads the vocabulary; padded columns get a huge negative logit so
    the distribution is the unpadded model's (the one generation samples from).
    """
    from megatron.core import parallel_state as ps

    from hybridflow.kernels import logprob_entropy, vocab_parallel_logprob_entropy

    logits = response_slice(output, batch)
    if temperature != 1.0:
        logits = logits / temperature
    labels = batch[F.RESPONSES]
    vocab, tp = engine.cfg.vocab_size, engine.layout.tp
    if tp == 1:
        return logprob_entropy(logits[..., :vocab], labels, backend=backend)
    width = logits.shape[-1]
    start = engine.layout.tp_rank * width
    padded = torch.arange(start, start + width, device=logits.device) >= vocab
    if padded.any():
        logits = logits.masked_fill(padded, -1e30)
    return vocab_parallel_logprob_entropy(logits, labels, group=ps.get_tensor_model_parallel_group())
