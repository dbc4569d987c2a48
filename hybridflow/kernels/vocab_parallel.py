"""Log-probs and entropy on vocabulary-sharded logits (tensor parallelism).

Megatron's output layer leaves each TP rank with logits[:, rank*Vr:(rank+1)*Vr].
The full softmax statistics are combined with three small all-reduces over
the TP group (max, then [sum exp, sum exp*x], then the target logit), so no
rank ever holds [tokens, V]. The backward needs no communication: with the
global log-sum-exp and entropy saved, each rank's logits gradient depends
only on its own shard.

    vocab_parallel_logprob_entropy(shard[N, Vr], labels[N], group) -> (logp[N], entropy[N])
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.kernels.logprob import chunk_grad, incoming_grads


def _local_target(shard: torch.Tensor, labels: torch.Tensor, start: int) -> torch.Tensor:
    local = labels - start
    inside = (local >= 0) & (local < shard.shape[-1])
    picked = shard.float().gather(-1, local.clamp(0, shard.shape[-1] - 1)[:, None]).squeeze(-1)
    return torch.where(inside, picked, 0.0)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, labels, group):
        rank = dist.get_rank(group)
        start = rank * shard.shape[-1]
        x = shard.float()
        m = x.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m[:, None])
        sums = torch.stack([e.sum(-1), (e * (x - m[:, None])).sum(-1), _local_target(x, labels, start)])
        del e
        dist.all_reduce(sums, group=group)
        sum_exp, weighted, target = sums
        lse = m + sum_exp.log()
        logp = target - lse
        entropy = sum_exp.log() - weighted / sum_exp
        ctx.save_for_backward(shard, labels, lse, entropy)
        ctx.start = start
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        shard, labels, lse, entropy = ctx.saved_tensors
        g_logp, g_ent = incoming_grads(g_logp, g_ent, lse)
        local = labels - ctx.start
        inside = (local >= 0) & (local < shard.shape[-1])
        # The label term lands only on the rank that owns the label.
        grad = chunk_grad(shard, local.clamp(0, shard.shape[-1] - 1), lse, entropy, g_logp, g_ent,
                           label_grad=torch.where(inside, g_logp, 0.0))
        return grad, None, None


def vocab_parallel_logprob_entropy(shard: torch.Tensor, labels: torch.Tensor, group=None):
    """`shard` holds this rank's contiguous slice of the vocabulary (rank order)."""
    shape = labels.shape
    out = _VocabParallelLogProbEntropy.apply(
        shard.reshape(-1, shard.shape[-1]), labels.reshape(-1).long(), group)
    return out[0].reshape(shape), out[1].reshape(shape)
