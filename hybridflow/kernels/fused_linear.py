"""Log-probs and entropy straight from hidden states and the output weight.

    fused_linear_logprob_entropy(hidden[N, H], weight[V, H], labels[N])
        -> (log_probs[N], entropy[N])  # float32

The [N, V] logits are never materialised: tokens are processed `chunk_size`
at a time, and the backward recomputes each chunk's logits, so the extra
peak memory is O(chunk_size * V) whatever N is. Per-chunk statistics use
`logprob_entropy`'s backends (C++ on CPU when available).
"""
from __future__ import annotations

import torch

from hybridflow.kernels.backend import cpu_extension, cuda_extension, resolve
from hybridflow.kernels.logprob import chunk_grad, incoming_grads, logprob_entropy

DEFAULT_CHUNK = 512


def fused_linear_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    from hybridflow.kernels.logprob import logprob_entropy_reference

    return logprob_entropy_reference(hidden @ weight.t(), labels)


class _FusedLinearLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, backend):
        logp, entropy, lse = [], [], []
        with torch.no_grad():
            for h, y in zip(hidden.split(chunk), labels.split(chunk)):
                lp, ent = logprob_entropy(h @ weight.t(), y, backend=backend)
                logp.append(lp)
                entropy.append(ent)
        logp, entropy = torch.cat(logp), torch.cat(entropy)
        ctx.save_for_backward(hidden, weight, labels, logp, entropy)
        ctx.chunk, ctx.backend = chunk, backend
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, logp, entropy = ctx.saved_tensors
        g_logp, g_ent = incoming_grads(g_logp, g_ent, logp)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        chosen = resolve(ctx.backend, hidden.device, ("cpu", "cuda", "chunked"))
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = s + ctx.chunk
            h, y = hidden[s:e], labels[s:e]
            logits = h @ weight.t()
            # lse = label logit - logp: recovered without storing it per token.
            lse = logits.float().gather(1, y[:, None]).squeeze(1) - logp[s:e]
            if chosen == "cpu":  # the chunk's logits are ours: the gradient overwrites them (no temporaries)
                g = cpu_extension().logprob_entropy_backward(logits, y, lse, entropy[s:e], g_logp[s:e],
                                                             g_ent[s:e], inplace=True)
            elif chosen == "cuda":
                g = cuda_extension().logprob_entropy_backward(logits, y, lse, entropy[s:e], g_logp[s:e], g_ent[s:e])
            else:
                g = chunk_grad(logits, y, lse, entropy[s:e], g_logp[s:e], g_ent[s:e])
            if grad_h is not None:
                grad_h[s:e] = (g @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(g.t().float(), h.float())
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def fused_linear_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_size: int = DEFAULT_CHUNK, backend: str = "auto"):
    """Leading dims of `labels` are kept; `hidden` is [..., H] with the same leading dims."""
    shape = labels.shape
    out = _FusedLinearLogProbEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1).long(), chunk_size, backend)
    return out[0].reshape(shape), out[1].reshape(shape)
