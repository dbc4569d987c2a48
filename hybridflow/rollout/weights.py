"""The actor's weights streamed into a rollout engine: whole (HF name, tensor) pairs, in buckets.

    sent = backend.load_weights(hf_named(actor_model))       # any engine's load_weights
    for bucket in buckets(hf_named(model), 64 * 2**20): ...   # what an engine with its own copy sends at once
    metrics = sync_weights(backend, generation_model)         # what a worker calls after each update

Weights travel under HF names because that is the one naming every engine can
load (vLLM's models take HF checkpoints; the built-in decoder maps them through
the bridge), as a lazy iterator so that a sender never builds a second whole
model: `hf_named` splits the generation model tensor by tensor and `buckets`
groups the pairs into at most `rollout.weight_bucket_mb` MiB per transfer.

`sync_weights` is what a worker calls after each update: an engine that
generates from the very model the 3D-HybridEngine refreshes (the built-in one
in the hybrid layout) moves nothing; one that keeps its own copy receives the
weights and the push is counted in the `reshard/*` metrics.
"""
from __future__ import annotations

import time
from typing import Iterator, Optional

import torch

from hybridflow.models.bridge import get_bridge
from hybridflow.models.decoder import Decoder
from hybridflow.models.sharding import unshard_tensor
from hybridflow.rollout.backend import Named, RolloutBackend

__all__ = ["buckets", "hf_named", "sync_weights"]


def hf_named(model: Decoder, make_vocab_size_divisible_by: int = 128,
             gathered: Optional[dict[str, int]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The generation model's weights as whole (HF name, tensor) pairs, one bridge entry at a time.

    Fused tensors (QKV, [gate; up]) are split into their HF parts as they are reached, so at most one
    entry's parts exist beside the model at a time; at tp = 1 plain tensors are the parameters themselves
    (detached). A tg-way model (`model.parallel.size > 1`, every rank of its group iterating in step)
    gathers each sharded entry over its group when it is reached, with the group's one gather
    (`TensorParallel.gather_vocab`, along the last dim), and drops the vocabulary padding. Beside its own
    shard a rank holds the bucket being consumed and the entry being gathered: while an entry is gathered
    about twice the whole entry (the gather buffer and its unsharded copy; the buffer is freed before the
    entry is handed on). That is never the whole model unless one entry is most of it, as the embedding of a
    small model with a large vocabulary may be. `gathered["bytes"]`, when given, adds up what this rank
    received from its peers.
    """
    parallel = model.parallel
    bridge = get_bridge(model.full_cfg, make_vocab_size_divisible_by)
    params = dict(model.named_parameters())
    for e in bridge.entries():
        local = params[e.generation].detach()
        if parallel.size > 1 and e.shard.dim is not None:
            whole = parallel.gather_vocab(local.movedim(e.shard.dim, -1).contiguous())
            pieces = [p.movedim(-1, e.shard.dim) for p in whole.chunk(parallel.size, dim=-1)]
            local = unshard_tensor(pieces, e.shard)
            if e.vocab:
                local = local[: model.full_cfg.vocab_size]
            if gathered is not None:
                gathered["bytes"] = gathered.get("bytes", 0) + whole.numel() * whole.element_size() * (
                    parallel.size - 1) // parallel.size
            del whole, pieces  # the gather buffer goes before the entry is handed on; the entry itself stays
        yield from zip(e.hf, bridge.split_parts(e, local))


def buckets(named: Named, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`named` in lists of at most `bucket_bytes` (a larger tensor travels alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def sync_weights(backend: RolloutBackend, source: Decoder, make_vocab_size_divisible_by: int = 128
                 ) -> dict[str, float]:
    """Bring `backend` up to `source`'s weights: nothing when it generates from `source` itself, else a push
    of (HF name, tensor) pairs. The push's bytes and seconds as `reshard/*` metrics (empty when none).

    A tg-way `source` is gathered entry by entry over its group as the push goes (`hf_named`), every rank
    of the group pushing the same whole tensors into its own engine's shard: `reshard/push_gather_bytes`
    is what this rank received for it, `reshard/push_peak_bytes` the largest bucket it held at once.
    """
    if getattr(backend, "model", None) is source:
        return {}
    start, gathered = time.perf_counter(), {"bytes": 0}
    sent = backend.load_weights(hf_named(source, make_vocab_size_divisible_by, gathered))
    metrics = {"reshard/push_bytes": float(sent), "reshard/push_time_s": time.perf_counter() - start}
    if source.parallel.size > 1:
        metrics["reshard/push_gather_bytes"] = float(gathered["bytes"])
    peak = getattr(backend, "largest_bucket_bytes", None)
    if peak is not None:
        metrics["reshard/push_peak_bytes"] = float(peak)
    return metrics

