"""Logging statistics: plain floats, valid tokens only, stable names."""
import math

import pytest
import torch

from hybridflow.algos import (advantage_stats, approx_kl, clip_fraction, entropy_mean, explained_variance,
                              masked_stats, ppo_clip_loss)
from tests.algos.helpers import make_mask, poison_padding


def test_clip_fraction_hand_and_agrees_with_loss():
    # same tokens as test_ppo_hand: t0 and t3 are clipped; t4 is padding (would be clipped)
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7), math.log(9.0)]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert clip_fraction(logp, torch.zeros(1, 5), adv, mask) == pytest.approx(0.5)
    gen = torch.Generator().manual_seed(60)
    mask = make_mask("holes", 8, 6, gen)
    old = torch.randn(8, 6, generator=gen)
    logp = old + 0.5 * torch.randn(8, 6, generator=gen)
    adv = torch.randn(8, 6, generator=gen)
    frac = clip_fraction(logp, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.2)
    metrics = ppo_clip_loss(logp, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.2).metrics
    assert 0 < frac < 1 and frac == pytest.approx(metrics["actor/clip_frac"])


def test_approx_kl_hand():
    # r = 2: (2 - 1) - ln 2 = 0.30685;  r = 1: 0;  padded token ignored
    logp = torch.tensor([[math.log(2.0), 0.0, 5.0]])
    got = approx_kl(logp, torch.zeros(1, 3), torch.tensor([[1, 1, 0]]))
    assert got == pytest.approx((1 - math.log(2.0)) / 2)
    assert isinstance(got, float)


def test_entropy_mean_and_masked_stats_hand():
    x = torch.tensor([[1.0, -2.0, 100.0], [4.0, -100.0, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert entropy_mean(x, mask) == pytest.approx(3.5 / 4)
    assert masked_stats(x, mask, "actor/x") == {"actor/x/mean": pytest.approx(3.5 / 4),
                                                "actor/x/max": 4.0, "actor/x/min": -2.0}
    assert masked_stats(x, torch.zeros(2, 3), "e") == {"e/mean": 0.0, "e/max": 0.0, "e/min": 0.0}


def test_explained_variance():
    gen = torch.Generator().manual_seed(61)
    mask = make_mask("right", 6, 5, gen)
    returns = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # a constant prediction explains nothing: Var(R - c) = Var(R)
    assert explained_variance(torch.full_like(returns, 3.0), returns, mask) == pytest.approx(0.0, abs=1e-12)
    assert explained_variance(-returns, returns, mask) == pytest.approx(-3.0)
    assert explained_variance(returns, torch.ones_like(returns), mask) == 0.0


def test_advantage_stats_keys_and_values():
    adv = torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.0, 0.0]])
    ret = torch.tensor([[1.0, 3.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    values = poison_padding(torch.tensor([[0.0, 1.0, 0.0], [7.0, 0.0, 0.0]]), mask)
    stats = advantage_stats(adv, ret, mask, values=values)
    assert stats["critic/advantages/mean"] == pytest.approx(0.5)
    assert (stats["critic/advantages/max"], stats["critic/advantages/min"]) == (2.0, -1.0)
    assert (stats["critic/returns/max"], stats["critic/returns/min"]) == (3.0, -2.0)
    assert stats["critic/values/mean"] == pytest.approx(8.0 / 3)
    assert math.isfinite(stats["critic/vf_explained_var"])
    assert all(isinstance(v, float) for v in stats.values())
    assert set(advantage_stats(adv, ret, mask)) == {f"critic/{n}/{s}" for n in ("advantages", "returns")
                                                    for s in ("mean", "max", "min")}
