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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_backward_on_a_private_copy_equals_the_out_of_place_one(dtype):
    """A strided slice (the response columns of a model output) is copied for the kernel anyway:
    the gradient then overwrites that copy, and the caller's tensor is untouched."""
    base, labels = _inputs(4 * 9, 1000, 3.0, dtype=dtype)
    base = base.view(4, 9, 1000)
    labels = labels.view(4, 9)[:, 2:7]

    def grads(inplace_allowed: bool):
        out = base.clone().requires_grad_(True)
        sliced = out[:, 2:7]  # not contiguous: logprob_entropy copies it
        before = out.detach().clone()
        if inplace_allowed:
            lp, ent = logprob_entropy(sliced, labels, backend="cpu")
        else:  # the same values, copied by the caller, so the kernel sees its own tensor (not private)
            lp, ent = logprob_entropy(sliced.contiguous(), labels, backend="cpu")
        (lp.sum() + 0.5 * ent.sum()).backward()
        assert torch.equal(out.detach(), before)  # the model output itself is never overwritten
        return out.grad

    torch.testing.assert_close(grads(True), grads(False), rtol=0, atol=0)


def test_in_place_backward_hands_back_the_kernels_own_copy_as_the_gradient():
    """No second [tokens, V] tensor: the gradient that reaches the caller's slice is stored in the
    copy the kernel saved in the forward. Out of place (the caller's own contiguous logits) it is not."""
    base = torch.randn(2, 9, 500).requires_grad_(True)
    labels = torch.randint(0, 500, (2, 8))
    for make_private, expect_shared in ((lambda t: t[:, :-1], True), (lambda t: t[:, :-1].contiguous(), False)):
        logits = make_private(base)
        seen = []
        logits.register_hook(lambda g: seen.append(g.untyped_storage().data_ptr()))
        lp, ent = logprob_entropy(logits, labels, backend="cpu")
        node = lp.grad_fn.next_functions[0][0]  # past the reshape to [2, 8]: the kernel's node
        saved = node.saved_tensors[0].untyped_storage().data_ptr()  # its [tokens, V] input
        (lp.sum() + ent.sum()).backward()
        assert (seen[0] == saved) is expect_shared


def test_in_place_backward_on_the_callers_logits_needs_permission():
    logits, labels = _inputs(16, 300, 3.0)
    x = logits.clone().requires_grad_(True)
    y = x * 1.0  # the caller's contiguous logits, kept by the caller
    lp, ent = logprob_entropy(y, labels, backend="cpu")
    (lp.sum() + ent.sum()).backward()
    torch.testing.assert_close(y.detach(), logits)  # not allowed: untouched
    z = x * 1.0
    lp, ent = logprob_entropy(z, labels, backend="cpu", inplace_backward=True)
    (lp.sum() + ent.sum()).backward()
    assert not torch.allclose(z.detach(), logits)  # allowed: the gradient now lives in z's storage


def test_a_second_backward_after_an_in_place_one_is_refused():
    """retain_graph=True would hand the second backward the first one's gradient as logits."""
    base = torch.randn(2, 9, 300).requires_grad_(True)
    labels = torch.randint(0, 300, (2, 8))
    lp, ent = logprob_entropy(base[:, :-1], labels, backend="cpu")
    (lp.sum() + ent.sum()).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        (lp.sum() + ent.sum()).backward()
