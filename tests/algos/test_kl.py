"""KL estimators, the KL reward penalty and loss, and the KL controllers."""
import math

import pytest
import torch

from hybridflow.algos import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, aggregate_loss,
                              apply_kl_penalty, build_kl_controller, get_kl_estimator, kl_loss, kl_penalty)
from tests.algos.helpers import MASK_KINDS, make_mask, poison_padding, valid_positions

LN2 = math.log(2.0)


@pytest.mark.parametrize("kind,want", [
    # logp = log 0.5, ref = log 0.25: logp - ref = ln 2, d = ref - logp = -ln 2
    ("k1", LN2), ("k2", 0.5 * LN2 ** 2), ("mse", 0.5 * LN2 ** 2),
    ("k3", 0.5 + LN2 - 1), ("low_var_kl", 0.5 + LN2 - 1), ("abs", LN2),
])
def test_kl_estimators_hand(kind, want):
    got = kl_penalty(torch.tensor([[math.log(0.5)]], dtype=torch.float64),
                     torch.tensor([[math.log(0.25)]], dtype=torch.float64), kind)
    assert got.item() == pytest.approx(want)


def test_kl_estimators_elementwise_sign():
    # the reverse pair flips k1 but not the symmetric estimators; k3 is not symmetric
    a, b = torch.tensor([-0.3, -2.0]), torch.tensor([-1.0, -0.1])
    torch.testing.assert_close(kl_penalty(a, b, "k1"), -kl_penalty(b, a, "k1"))
    torch.testing.assert_close(kl_penalty(a, b, "abs"), kl_penalty(b, a, "abs"))
    assert (kl_penalty(a, b, "k3") >= 0).all() and (kl_penalty(b, a, "k3") >= 0).all()
    assert not torch.allclose(kl_penalty(a, b, "k3"), kl_penalty(b, a, "k3"))


def test_k3_is_clamped_and_has_finite_gradient_for_extreme_ratios():
    logp = torch.tensor([-60.0, -1.0, -0.5], requires_grad=True)
    ref = torch.tensor([-0.1, -80.0, -0.5])
    kl = kl_penalty(logp, ref, "low_var_kl")
    # ref - logp = 59.9 -> exp overflows without the clamp -> bounded at 10
    # ref - logp = -79  -> exp(d) - d - 1 = 78 -> bounded at 10
    assert kl.tolist()[:2] == [10.0, 10.0] and kl[2].item() == 0.0
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_k1_and_k3_estimate_the_true_kl():
    # sample tokens from pi, average the per-token estimates, compare with the
    # exact KL(pi || ref) of the two categorical distributions
    pi = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = (pi * (pi / ref).log()).sum().item()
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    for kind in ("k1", "k3"):
        est = kl_penalty(pi.log()[tokens], ref.log()[tokens], kind).mean().item()
        assert est == pytest.approx(exact, abs=4e-3), kind


def test_kl_registry():
    assert get_kl_estimator("mse") is get_kl_estimator("k2")
    assert get_kl_estimator("low_var_kl") is get_kl_estimator("k3")
    assert {"k1", "k2", "k3", "mse", "low_var_kl", "abs"} <= set(KL_ESTIMATORS)
    with pytest.raises(KeyError, match="'low_var_k1'; nearest registered: 'low_var_kl'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "low_var_k1")


def test_apply_kl_penalty_hand():
    # k1 on valid tokens: [0.5, -0.25] (row 0), [1.0] (row 1); coef 0.1
    # per-sequence means 0.125 and 1.0; the empty row 2 does not count -> mean 0.5625
    rewards = torch.tensor([[0.0, 1.0, 4.0], [2.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    logp = torch.tensor([[-0.5, -1.25, 0.0], [0.0, 9.0, 9.0], [1.0, 1.0, 1.0]])
    ref = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    new, mean_kl = apply_kl_penalty(rewards, logp, ref, mask, kl_coef=0.1, kind="k1")
    torch.testing.assert_close(new, torch.tensor([[-0.05, 1.025, 0.0], [1.9, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert mean_kl == pytest.approx(0.5625)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_apply_kl_penalty_matches_loop(kind, estimator):
    gen = torch.Generator().manual_seed(50)
    mask = make_mask(kind, 6, 5, gen)
    rewards, logp, ref = (torch.randn(6, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    elementwise = {"k1": lambda a, b: a - b,
                   "k2": lambda a, b: 0.5 * (a - b) ** 2,
                   "k3": lambda a, b: min(math.exp(b - a) - (b - a) - 1, 10.0),  # clamped like the code
                   "abs": lambda a, b: abs(a - b)}[estimator]
    want = torch.zeros(6, 5, dtype=torch.float64)
    seq_means = []
    for b in range(6):
        kls = []
        for t in valid_positions(mask[b]):
            kl = elementwise(logp[b, t].item(), ref[b, t].item())
            want[b, t] = rewards[b, t].item() - 0.2 * kl
            kls.append(kl)
        if kls:
            seq_means.append(sum(kls) / len(kls))
    new, mean_kl = apply_kl_penalty(poison_padding(rewards, mask), poison_padding(logp, mask, float("-inf")),
                                    ref, mask, kl_coef=0.2, kind=estimator)
    torch.testing.assert_close(new, want)
    assert mean_kl == pytest.approx(sum(seq_means) / len(seq_means))


def test_kl_loss_is_aggregated_estimate_with_gradient():
    gen = torch.Generator().manual_seed(51)
    mask = make_mask("holes", 5, 4, gen)
    logp = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    loss = kl_loss(logp, ref, mask, kind="k2", loss_agg_mode="seq-mean-token-mean")
    want = aggregate_loss(0.5 * (logp.detach() - ref) ** 2, mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(want.item())
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask != 0] != 0).all()


def test_fixed_kl_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=10.0, n_steps=1000)
    assert ctl.value == 0.05


def test_adaptive_kl_controller_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctl.update(current_kl=0.15, n_steps=10)  # error 0.5 clipped to 0.2 -> x(1 + 0.2*10/100) = x1.02
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=0.11, n_steps=10)  # error 0.1 -> x1.01
    assert ctl.value == pytest.approx(0.102 * 1.01)
    ctl.update(current_kl=0.0, n_steps=50)  # error -1 clipped to -0.2 -> x0.9
    assert ctl.value == pytest.approx(0.102 * 1.01 * 0.9)
    with pytest.raises(ValueError, match="target_kl > 0"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


def test_build_kl_controller():
    assert isinstance(build_kl_controller("fixed", 0.01), FixedKLController)
    ctl = build_kl_controller("adaptive", 0.01, target_kl=0.2, horizon=7)
    assert isinstance(ctl, AdaptiveKLController) and (ctl.value, ctl.target_kl, ctl.horizon) == (0.01, 0.2, 7)
    with pytest.raises(ValueError, match="unknown KL controller 'adaptiv'"):
        build_kl_controller("adaptiv", 0.01)
