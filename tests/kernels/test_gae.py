"""GAE and discounted-return scans: C++ equals the reference; the reference equals a plain loop."""
import pytest
import torch

from hybridflow.kernels import discounted_returns, gae, gae_reference


def _loop_gae(r, v, m, gamma, lam):
    """Independent check: drop masked steps, run textbook GAE, scatter back."""
    adv, ret = torch.zeros_like(r), torch.zeros_like(r)
    for b in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if m[b, t]]
        last_a, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = r[b, t].item() + gamma * next_v - v[b, t].item()
            last_a = delta + gamma * lam * last_a
            adv[b, t], ret[b, t] = last_a, last_a + v[b, t].item()
            next_v = v[b, t].item()
    return adv, ret


def _inputs(b, t, seed=0, holes=True):
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    m = (torch.arange(t)[None] < lengths[:, None]).float()
    if holes:
        m *= (torch.rand(b, t, generator=g) > 0.2).float()
    m[0] = 0.0  # a fully masked row
    if b > 1:
        m[1] = 0.0
        m[1, 0] = 1.0  # a length-1 row
    return r, v, m


def test_hand_computed_case():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = gae_reference(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5]]))  # return 1 minus value 0.5
    adv, _ = gae_reference(r, v, torch.ones(1, 3), gamma=0.5, lam=0.5)
    # deltas: [-0.25, -0.25, 0.5]; adv_2 = 0.5, adv_1 = -0.25 + .25*.5, adv_0 = -0.25 + .25*adv_1
    torch.testing.assert_close(adv, torch.tensor([[-0.28125, -0.125, 0.5]]))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_reference_matches_loop_with_padding_and_holes(gamma, lam):
    r, v, m = _inputs(6, 9)
    for a, b in zip(gae_reference(r, v, m, gamma, lam), _loop_gae(r, v, m, gamma, lam)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("b, t", [(1, 1), (7, 33), (64, 300)])
def test_cpu_backend_matches_reference(b, t):
    r, v, m = _inputs(b, t, seed=b)
    for a, c in zip(gae(r, v, m, 0.99, 0.95, backend="cpu"), gae_reference(r, v, m, 0.99, 0.95)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b, t", [(1, 1), (2, 1), (7, 33), (64, 300)])
def test_whitening_fused_into_the_cpu_scan_equals_masked_whiten_afterwards(b, t):
    from hybridflow.kernels.masked import masked_whiten

    r, v, m = _inputs(b, t, seed=b)
    r, v = r * 3 + 5, v * 2  # a mean and scale far from (0, 1), so whitening has work to do
    r[m == 0], v[m == 0] = float("nan"), float("inf")  # padding must not leak into the statistics
    want_adv, want_ret = gae_reference(r, v, m, 0.99, 0.95)
    want_adv = masked_whiten(want_adv, m)
    for backend in ("cpu", "reference"):
        adv, ret = gae(r, v, m, 0.99, 0.95, backend=backend, whiten=True)
        torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-5, msg=backend)
        torch.testing.assert_close(ret, want_ret, rtol=1e-5, atol=1e-5, msg=backend)  # returns are not whitened
        assert (adv[m == 0] == 0).all()
    valid = adv[m.bool()].double()
    if valid.numel() > 1:
        assert valid.mean().abs() < 1e-5 and (valid.std() - 1).abs() < 1e-4


def test_discounted_returns():
    r = torch.tensor([[1.0, 0.0, 2.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    for backend in ("reference", "cpu"):
        torch.testing.assert_close(discounted_returns(r, m, 0.5, backend=backend),
                                   torch.tensor([[1.5, 1.0, 2.0, 0.0]]))


def test_an_extension_backend_refuses_tensors_of_another_device():
    from hybridflow.kernels.backend import BackendUnavailable, resolve
    with pytest.raises(BackendUnavailable, match="runs on cpu tensors"):
        resolve("cpu", torch.device("meta"), ("cpu",))
