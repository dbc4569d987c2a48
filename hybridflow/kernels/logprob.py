"""Token log-probabilities and entropy from logits, without a full log-softmax.

    logprob_entropy(logits[..., V], labels[...]) -> (log_probs[...], entropy[...])  # float32

Backends (see `backend.py`):
- `reference`: eager `log_softmax` + `gather` + entropy; materialises several
  [tokens, V] float32 temporaries. The ground truth for tests.
- `chunked`: plain PyTorch over chunks of tokens, forward and backward, so
  temporaries are [chunk, V]; runs on any device.
- `cpu`: C++ (csrc/cpu/kernels.cpp): two passes over each row, no [tokens, V]
  temporary in the forward; backward writes the logits gradient directly.
- `cuda`: CUDA (csrc/cuda/logprob_entropy.cu): one read of each row (online
  softmax), one block per row; backward reads logits once, writes the gradient.
  A label outside [0, V) gives log p = NaN there (a kernel cannot raise).
Outputs are float32 whatever the logits dtype (bfloat16 is upcast per row).
"""
from __future__ import annotations

import torch

from hybridflow.kernels.backend import cpu_extension, cuda_extension, resolve

DEFAULT_CHUNK = 1024


def logprob_entropy_reference(logits: torch.Tensor, labels: torch.Tensor):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _chunk_stats(x: torch.Tensor, labels: torch.Tensor):
    x = x.float()
    lse = torch.logsumexp(x, dim=-1)
    logp_all = x - lse[:, None]
    # -sum p log p, not lse - sum p x: the latter cancels badly for large logits.
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return x.gather(-1, labels[:, None]).squeeze(-1) - lse, entropy, lse


def chunk_grad(x, labels, lse, entropy, g_logp, g_ent, label_grad=None):
    """d/dx of (g_logp * logp + g_ent * H) for one chunk of rows.

    `label_grad` (default `g_logp`) is what lands on each row's label column;
    the vocab-parallel kernel zeroes it on rows whose label another rank owns.
    """
    logp_all = x.float() - lse[:, None]
    p = logp_all.exp()
    grad = -(g_logp[:, None] * p) - g_ent[:, None] * p * (logp_all + entropy[:, None])
    label_grad = g_logp if label_grad is None else label_grad
    grad.scatter_add_(1, labels[:, None], label_grad[:, None])
    return grad.to(x.dtype)


def incoming_grads(g_logp, g_ent, like: torch.Tensor):
    """float32 upstream gradients; an output that was not used arrives as None."""
    zeros = torch.zeros_like(like, dtype=torch.float32)
    return (zeros if g_logp is None else g_logp.float(), zeros if g_ent is None else g_ent.float())


class _ChunkedLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk):
        outs = [_chunk_stats(x, y) for x, y in zip(logits.split(chunk), labels.split(chunk))]
        logp, entropy, lse = (torch.cat(t) for t in zip(*outs))
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.chunk = chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, labels, lse, entropy = ctx.saved_tensors
        g_logp, g_ent = incoming_grads(g_logp, g_ent, lse)
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            e = s + ctx.chunk
            grad[s:e] = chunk_grad(logits[s:e], labels[s:e], lse[s:e], entropy[s:e], g_logp[s:e], g_ent[s:e])
        return grad, None, None


class _ExtensionLogProbEntropy(torch.autograd.Function):
    """The C++ or CUDA kernels; both extensions expose the same two functions.

    inplace (C++ only): the backward writes the gradient into the saved
    logits' storage instead of a new [tokens, V] tensor, the memory floor of
    an unfused backward. Only for logits nothing else reads after this
    backward (the raw-pointer write bumps no version counter).
    """

    @staticmethod
    def forward(ctx, logits, labels, extension, inplace):
        logp, entropy, lse = extension.logprob_entropy_forward(logits, labels)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.extension, ctx.inplace = extension, inplace
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, labels, lse, entropy = ctx.saved_tensors
        g_logp, g_ent = incoming_grads(g_logp, g_ent, lse)
        if ctx.inplace:
            if getattr(ctx, "spent", False):
                raise RuntimeError("logprob_entropy: its backward ran once already and wrote the gradient over "
                                   "the saved logits; a second backward (retain_graph=True) needs "
                                   "inplace_backward=False and logits the kernel does not copy")
            ctx.spent = True
            ctx.extension.logprob_entropy_backward(logits, labels, lse, entropy, g_logp, g_ent, inplace=True)
            return logits.detach(), None, None, None
        return ctx.extension.logprob_entropy_backward(logits, labels, lse, entropy, g_logp, g_ent), None, None, None


def logprob_entropy(logits: torch.Tensor, labels: torch.Tensor, backend: str = "auto",
                    chunk_size: int = DEFAULT_CHUNK,
                    inplace_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and entropy per token; leading dims of `labels` are kept.

    On the C++ backend the backward writes the logits gradient over the
    logits themselves when that is safe: always when the kernel works on a
    private copy (a strided slice, such as the response columns of a model's
    output, is copied here anyway), and on the caller's own logits when it
    passes `inplace_backward=True`, promising that nothing reads them after
    this backward. Either way no second [tokens, V] tensor is allocated.
    """
    shape = labels.shape
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    chosen = resolve(backend, logits.device, ("cpu", "cuda", "chunked"))
    if chosen in ("cpu", "cuda"):
        extension = cpu_extension() if chosen == "cpu" else cuda_extension()
        flat = flat.contiguous()
        private = flat.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
        inplace = chosen == "cpu" and (private or inplace_backward)
        out = _ExtensionLogProbEntropy.apply(flat, flat_labels.contiguous(), extension, inplace)
    elif chosen == "chunked":
        out = _ChunkedLogProbEntropy.apply(flat, flat_labels, chunk_size)
    else:
        out = logprob_entropy_reference(flat, flat_labels)
    return out[0].reshape(shape), out[1].reshape(shape)
