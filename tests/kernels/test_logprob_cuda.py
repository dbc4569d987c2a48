"""The CUDA log-prob/entropy backend equals the eager reference on the GPU, values and gradients."""
import pytest
import torch

from hybridflow.kernels import logprob_entropy, logprob_entropy_reference
from hybridflow.kernels.backend import resolve
from tests.kernels.test_cuda_build import _expected
from tests.kernels.test_logprob import CASES, _inputs

pytestmark = pytest.mark.gpu


def _value_and_grads(fn, logits, labels, seed=1):
    x = logits.cuda().requires_grad_(True)
    lp, ent = fn(x, labels.cuda())
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(lp.shape, generator=g, device="cuda")
    w2 = torch.randn(lp.shape, generator=g, device="cuda")
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def _cuda(x, y):
    return logprob_entropy(x, y, backend="cuda")


def _assert_matches(logits, labels, rtol, atol):
    ref = _value_and_grads(logprob_entropy_reference, logits, labels)
    out = _value_and_grads(_cuda, logits, labels)
    assert out[0].dtype == torch.float32 and out[2].dtype == logits.dtype
    for name, a, b in zip(("logp", "entropy", "grad"), out, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("n, v, scale", CASES)
def test_cuda_matches_reference_float32(n, v, scale):
    _assert_matches(*_inputs(n, v, scale), rtol=1e-4, atol=1e-4 * max(1.0, scale / 10))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, v", [(48, 2051), (1, 7), (64, 32000)])
def test_cuda_matches_reference_half_precision(dtype, n, v):
    _assert_matches(*_inputs(n, v, 4.0, dtype=dtype), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seed", range(4))
def test_cuda_matches_reference_random_shapes(seed):
    g = torch.Generator().manual_seed(seed)
    n, v = torch.randint(1, 300, (1,), generator=g).item(), torch.randint(1, 70000, (1,), generator=g).item()
    _assert_matches(*_inputs(n, v, 5.0, seed=seed), rtol=1e-4, atol=1e-4)


def test_cuda_large_vocab_bfloat16():
    _assert_matches(*_inputs(128, 151936, 3.0, dtype=torch.bfloat16), rtol=2e-2, atol=2e-2)


def test_misaligned_logits_and_side_stream():
    """A view one element into its storage (scalar head; gradient alignment differs), on a non-default stream."""
    n, v = 33, 4096
    logits, labels = _inputs(n, v, 3.0)
    flat = torch.empty(n * v + 1, device="cuda")
    flat[1:] = logits.reshape(-1).cuda()
    x = flat[1:].view(n, v)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    ref = _value_and_grads(logprob_entropy_reference, logits, labels)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = _value_and_grads(_cuda, x, labels)
    torch.cuda.current_stream().wait_stream(stream)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_leading_dims_only_logp_grad_and_empty():
    logits, labels = _inputs(24, 50, 2.0)
    x = logits.view(4, 6, 50).cuda().requires_grad_(True)
    lp, ent = logprob_entropy(x, labels.view(4, 6).cuda(), backend="cuda")
    assert lp.shape == ent.shape == (4, 6)
    lp.sum().backward()  # entropy unused; the incoming logp gradient is an expanded scalar
    expect = -torch.softmax(logits, -1)
    expect[torch.arange(24), labels] += 1
    torch.testing.assert_close(x.grad.view(24, 50).cpu(), expect, rtol=1e-5, atol=1e-6)
    lp, ent = logprob_entropy(torch.zeros(0, 50, device="cuda"), torch.zeros(0, dtype=torch.long, device="cuda"),
                              backend="cuda")
    assert lp.shape == ent.shape == (0,)


def test_invalid_labels_give_nan_logp_and_masked_logits_zero_gradient():
    logits, labels = _inputs(4, 1000, 3.0)
    logits[:, 500:700] = float("-inf")
    labels = torch.tensor([-100, 1000, 5, 999])
    g_logp, g_ent = torch.ones(4), torch.full((4,), 0.5)
    x = logits.cuda().requires_grad_(True)
    lp, ent = logprob_entropy(x, labels.cuda(), backend="cuda")
    (grad,) = torch.autograd.grad((lp, ent), x, (g_logp.cuda(), g_ent.cuda()))
    assert lp[:2].isnan().all() and lp[2:].isfinite().all()
    assert (grad[:, 500:700] == 0).all()
    # -inf clamped to -1e4 is the same distribution without the reference's 0 * -inf = NaN.
    expect = _expected(logits.clamp(min=-1e4), labels, g_logp, g_ent)
    for a, b in zip((lp, ent, grad), (expect[0], expect[1], expect[3])):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_auto_picks_cuda_on_a_cuda_tensor():
    assert resolve("auto", torch.device("cuda"), ("cpu", "cuda", "chunked")) == "cuda"
    logits, labels = _inputs(8, 300, 1.0)
    a = logprob_entropy(logits.cuda(), labels.cuda())
    b = logprob_entropy(logits.cuda(), labels.cuda(), backend="cuda")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
