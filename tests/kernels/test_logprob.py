"""Every log-prob/entropy backend equals the eager reference, values and gradients."""
import pytest
import torch

from hybridflow.kernels import (
    fused_linear_logprob_entropy, fused_linear_reference, logprob_entropy, logprob_entropy_reference)

CASES = [  # (tokens, vocab, scale): vocab not a multiple of any chunk; huge and tiny logits
    (1, 7, 1.0), (37, 1000, 3.0), (64, 4099, 30.0), (5, 513, 1e-4), (16, 300, 500.0)]


def _inputs(n, v, scale, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    return logits, labels


def _value_and_grads(fn, logits, labels):
    x = logits.clone().requires_grad_(True)
    lp, ent = fn(x, labels)
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("backend", ["chunked", "cpu", "auto"])
@pytest.mark.parametrize("n, v, scale", CASES)
def test_backend_matches_reference_float32(backend, n, v, scale):
    logits, labels = _inputs(n, v, scale)
    ref = _value_and_grads(logprob_entropy_reference, logits, labels)
    out = _value_and_grads(lambda x, y: logprob_entropy(x, y, backend=backend, chunk_size=8), logits, labels)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * max(1.0, scale / 10))


@pytest.mark.parametrize("backend", ["chunked", "cpu"])
def test_backend_matches_reference_bfloat16(backend):
    logits, labels = _inputs(48, 2051, 4.0, dtype=torch.bfloat16)
    ref = _value_and_grads(logprob_entropy_reference, logits, labels)
    out = _value_and_grads(lambda x, y: logprob_entropy(x, y, backend=backend), logits, labels)
    assert out[0].dtype == torch.float32 and out[2].dtype == torch.bfloat16
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", ["chunked", "cpu"])
def test_large_vocab_peaked_rows_are_as_exact_as_eager(backend):
    """A real model's rows: vocab 49152, one logit far above the rest. Float32 sums over a whole row
    drop the tail (each term under half an ulp of the running sum); the error must stay within
    twice eager PyTorch's, measured against float64."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 49152, generator=g) * 2.0 + 25.0
    top = torch.randint(0, 49152, (32,), generator=g)
    logits[torch.arange(32), top] += 14.0
    labels = torch.where(torch.arange(32) % 2 == 0, top, torch.randint(0, 49152, (32,), generator=g))
    all64 = torch.log_softmax(logits.double(), -1)
    exact = all64.gather(-1, labels[:, None])[:, 0], -(all64.exp() * all64).sum(-1)
    eager = logprob_entropy_reference(logits, labels)
    ours = logprob_entropy(logits, labels, backend=backend)
    for a, b, e in zip(ours, eager, exact):
        assert (a.double() - e).abs().max() <= 2 * (b.double() - e).abs().max() + 1e-6


def test_leading_dims_kept_and_only_logp_grad():
    logits, labels = _inputs(24, 50, 2.0)
    x = logits.view(4, 6, 50).clone().requires_grad_(True)
    lp, ent = logprob_entropy(x, labels.view(4, 6), backend="cpu")
    assert lp.shape == ent.shape == (4, 6)
    lp.sum().backward()  # entropy unused: its incoming gradient is None
    ref = torch.log_softmax(logits, -1)
    expect = -ref.exp()
    expect[torch.arange(24), labels] += 1
    torch.testing.assert_close(x.grad.view(24, 50), expect, rtol=1e-5, atol=1e-6)


def test_uniform_logits_have_log_v_entropy():
    lp, ent = logprob_entropy(torch.zeros(3, 128), torch.tensor([0, 5, 127]), backend="cpu")
    torch.testing.assert_close(ent, torch.full((3,), torch.log(torch.tensor(128.0)).item()))
    torch.testing.assert_close(lp, -ent)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown kernel backend 'fast'"):
        logprob_entropy(torch.zeros(1, 3), torch.tensor([0]), backend="fast")


@pytest.mark.parametrize("n, h, v, chunk", [(1, 8, 11, 4), (70, 32, 257, 16), (33, 16, 1000, 64)])
def test_fused_linear_matches_reference(n, h, v, chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    labels = torch.randint(0, v, (n,), generator=g)

    def run(fn):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = fn(hh, ww, labels)
        (lp.sum() * 0.7 - ent.sum() * 0.3).backward()
        return lp.detach(), ent.detach(), hh.grad, ww.grad

    ref = run(fused_linear_reference)
    out = run(lambda a, b, c: fused_linear_logprob_entropy(a, b, c, chunk_size=chunk))
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
