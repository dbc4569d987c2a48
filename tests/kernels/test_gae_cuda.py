"""The CUDA GAE scan on a GPU: equals the reference, and `auto` picks it (run with `pytest -m gpu`)."""
import pytest
import torch

from hybridflow.kernels import discounted_returns, gae, gae_reference
from hybridflow.kernels.backend import resolve
from tests.kernels.test_gae import _inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b, t", [(1, 1), (5, 31), (7, 33), (64, 2048), (3, 8192)])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95)])
def test_cuda_matches_reference(b, t, gamma, lam):
    r, v, m = _inputs(b, t, seed=t)
    want = gae_reference(r.double(), v.double(), m, gamma, lam)
    got = gae(r.cuda(), v.cuda(), m.cuda(), gamma, lam, backend="cuda")
    tol = 1e-5 * max(1.0, t ** 0.5)
    for a, c in zip(got, want):
        assert a.is_cuda
        torch.testing.assert_close(a.cpu(), c.float(), rtol=tol, atol=tol)


def test_auto_picks_cuda_and_returns_match():
    assert resolve("auto", torch.device("cuda"), ("cpu", "cuda")) == "cuda"
    r = torch.tensor([[1.0, 0.0, 2.0, 0.0]], device="cuda")
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]], device="cuda")
    torch.testing.assert_close(discounted_returns(r, m, 0.5).cpu(), torch.tensor([[1.5, 1.0, 2.0, 0.0]]))
