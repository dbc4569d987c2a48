"""Policy and value losses: hand cases, loop references and autograd checks."""
import inspect
import math

import pytest
import torch

from hybridflow.algos import (LOSS_AGG_MODES, POLICY_LOSSES, aggregate_loss, get_policy_loss, gspo_loss,
                              ppo_clip_loss, value_loss)
from hybridflow.config.schema import ActorConfig
from tests.algos.helpers import MASK_KINDS, make_mask, poison_padding, valid_positions


def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


# ---------------------------------------------------------------- PPO


def test_ppo_hand():
    # ratios r = [1.5, 0.5, 1.1, 0.7], A = [1, 1, -1, -1], clip range [0.8, 1.2]:
    # t0: max(-1.5, -1.2) = -1.2 clipped | t1: max(-0.5, -0.8) = -0.5
    # t2: max( 1.1,  1.1) =  1.1         | t3: max( 0.7,  0.8) =  0.8 clipped
    # token-mean = (-1.2 - 0.5 + 1.1 + 0.8) / 4 = 0.05; d/dlogp = -A r / 4 where unclipped
    logp = leaf([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7)]])
    out = ppo_clip_loss(logp, torch.zeros(1, 4, dtype=torch.float64), torch.tensor([[1.0, 1.0, -1.0, -1.0]]),
                        torch.ones(1, 4))
    assert out.loss.item() == pytest.approx(0.05)
    assert out.metrics["actor/clip_frac"] == pytest.approx(0.5)
    assert out.metrics["actor/dual_clip_frac"] == 0.0
    assert out.metrics["actor/pg_loss"] == pytest.approx(0.05)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.125, 0.275, 0.0]], dtype=torch.float64))


def test_ppo_asymmetric_clip_range():
    # low 0.2, high 0.28, A = 1: r = 1.25 is inside (loss -1.25); r = 1.3 clips to -1.28;
    # A = -1: r = 0.79 clips at 0.8 (loss 0.8)
    logp = leaf([[math.log(1.25), math.log(1.3), math.log(0.79)]])
    out = ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3),
                        clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-sum")
    assert out.loss.item() == pytest.approx(-1.25 - 1.28 + 0.8)
    assert out.metrics["actor/clip_frac"] == pytest.approx(2 / 3)


def test_dual_clip_hand():
    # r = 5: A = -1 -> max(5, 1.2) = 5, bounded by c = 3 -> 3 (dual clip, no gradient);
    #        A = +1 -> max(-5, -1.2) = -1.2 (ordinary clip; dual clip never applies to A > 0)
    # r = 2, A = -1 -> 2 < 3: untouched, gradient -A r / 3 = 2/3
    logp = leaf([[math.log(5.0), math.log(5.0), math.log(2.0)]])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    out = ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx((3.0 - 1.2 + 2.0) / 3)
    assert out.metrics["actor/dual_clip_frac"] == pytest.approx(1 / 3)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 2 / 3]], dtype=torch.float64))
    without = ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=None)
    assert without.loss.item() == pytest.approx((5.0 - 1.2 + 2.0) / 3)
    # The function's default is the config's (actor.clip_ratio_c = 3.0): the dual clip is on.
    assert ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3)).loss.item() == pytest.approx(out.loss.item())
    assert inspect.signature(ppo_clip_loss).parameters["clip_ratio_c"].default == ActorConfig().clip_ratio_c
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_clip_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=0.9)


def ppo_loop(logp, old, adv, mask, low, high, c):
    """Per-token loss matrix and clip flags, one Python float at a time."""
    loss = torch.zeros(logp.shape, dtype=torch.float64)
    clipped = torch.zeros(logp.shape, dtype=torch.bool)
    for b in range(logp.shape[0]):
        for t in valid_positions(mask[b]):
            r = math.exp(logp[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            l1, l2 = -a * r, -a * min(max(r, 1 - low), 1 + high)
            value = max(l1, l2)
            clipped[b, t] = l2 > l1
            if c is not None and a < 0:
                value = min(value, -a * c)
            loss[b, t] = value
    return loss, clipped


def random_policy_batch(kind, seed, batch=8, length=6):
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(kind, batch, length, gen)
    old = torch.randn(batch, length, generator=gen, dtype=torch.float64) - 2
    logp = old + 0.4 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return logp, old, adv, mask


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("c", [None, 1.5])
def test_ppo_matches_loop(kind, mode, c):
    logp, old, adv, mask = random_policy_batch(kind, seed=40)
    want_mat, want_clip = ppo_loop(logp, old, adv, mask, 0.2, 0.3, c)
    logp_in = poison_padding(logp, mask, float("-inf")).requires_grad_(True)
    out = ppo_clip_loss(logp_in, poison_padding(old, mask, float("-inf")), poison_padding(adv, mask), mask,
                        clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=c, loss_agg_mode=mode)
    assert out.loss.item() == pytest.approx(aggregate_loss(want_mat, mask, mode).item())
    assert out.metrics["actor/clip_frac"] == pytest.approx(want_clip.sum().item() / mask.sum().item())
    assert 0 < out.metrics["actor/clip_frac"] < 1  # the batch exercises both branches
    out.loss.backward()
    assert torch.isfinite(logp_in.grad).all()


@pytest.mark.parametrize("c", [None, 1.5])
def test_ppo_gradient_is_zero_exactly_where_clipped(c):
    logp, old, adv, mask = random_policy_batch("holes", seed=41)
    logp = logp.requires_grad_(True)
    out = ppo_clip_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=c)
    out.loss.backward()
    _, clipped = ppo_loop(logp.detach(), old, adv, mask, 0.2, 0.3, c)
    ratio = (logp.detach() - old).exp()
    dual = (adv < 0) & (-adv * ratio > -adv * c) & ~clipped if c is not None else torch.zeros_like(clipped)
    frozen = clipped | dual | (mask == 0)
    assert clipped.any() and (~frozen).any()
    assert (logp.grad[frozen] == 0).all()
    # elsewhere: d/dlogp of -A r under token-mean is -A r / n_valid
    want = -adv * ratio / mask.sum()
    torch.testing.assert_close(logp.grad[~frozen], want[~frozen])


# ---------------------------------------------------------------- GSPO


def test_gspo_hand():
    # log-ratios [0.1, 0.3] -> mean 0.2 -> s = e^0.2 = 1.2214, A = 1.
    # clip at 1.2 (high 0.2): loss -1.2 and no gradient;
    # high 0.3: loss -1.2214, gradient -s / 2 on each token (seq-mean-token-mean).
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    logp = leaf([[0.1, 0.3]])
    out = gspo_loss(logp, old, adv, torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert out.loss.item() == pytest.approx(-1.2)
    assert out.metrics["actor/clip_frac"] == 1.0
    out.loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0]]
    logp = leaf([[0.1, 0.3]])
    out = gspo_loss(logp, old, adv, torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.3)
    s = math.exp(0.2)
    assert out.loss.item() == pytest.approx(-s)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -s / 2, dtype=torch.float64))


def gspo_sequence_reference(logp, old, seq_adv, mask, low, high):
    """GSPO as written in the paper: one ratio per sequence, mean over sequences."""
    terms = []
    for b in range(logp.shape[0]):
        ts = valid_positions(mask[b])
        if not ts:
            continue
        s = torch.exp(sum(logp[b, t] - old[b, t] for t in ts) / len(ts))
        a = seq_adv[b].item()
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - low, 1 + high)))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_gspo_matches_sequence_level_formula_value_and_gradient(kind):
    logp, old, _, mask = random_policy_batch(kind, seed=42, batch=10)
    logp = (old + 0.1 * (logp - old)).detach()  # ratios around 1, some inside the range
    seq_adv = torch.randn(10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    adv = seq_adv[:, None].expand(mask.shape)
    a = logp.clone().requires_grad_(True)
    out = gspo_loss(poison_padding(a, mask, float("-inf")), old, adv, mask,
                    clip_ratio_low=0.03, clip_ratio_high=0.04)
    b = logp.clone().requires_grad_(True)
    want = gspo_sequence_reference(b, old, seq_adv, mask, 0.03, 0.04)
    assert out.loss.item() == pytest.approx(want.item())
    out.loss.backward()
    want.backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert (a.grad != 0).any() and 0 < out.metrics["actor/clip_frac"] < 1


# ---------------------------------------------------------------- value loss


def test_value_loss_hand():
    # c = 0.5, old = 0:
    # t0: v 1.0, R 2 -> (1-2)^2 = 1 vs (0.5-2)^2 = 2.25 -> 2.25 (clipped: no gradient)
    # t1: v 0.2, R 0 -> 0.04 both ways -> 0.04, gradient 0.5 * 2 * 0.2 / 3
    # t2: v 1.0, R 0 -> 1 vs 0.25 -> 1 (unclipped term wins), gradient 0.5 * 2 * 1 / 3
    values = leaf([[1.0, 0.2, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    returns = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    out = value_loss(values, torch.zeros(1, 4), returns, mask, cliprange_value=0.5)
    assert out.loss.item() == pytest.approx(0.5 * (2.25 + 0.04 + 1.0) / 3)
    assert out.metrics["critic/vf_clip_frac"] == pytest.approx(1 / 3)
    assert out.metrics["critic/vpred_mean"] == pytest.approx(2.2 / 3)
    out.loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.2 / 3, 1 / 3, 0.0]], dtype=torch.float64))
    unclipped = value_loss(values, torch.zeros(1, 4), returns, mask, cliprange_value=None)
    assert unclipped.loss.item() == pytest.approx(0.5 * (1.0 + 0.04 + 1.0) / 3)


def test_value_steps_inside_the_range_are_never_counted_as_clipped():
    """float32 old + (v - old) can round away from v; a step inside the range is not a clip."""
    g = torch.Generator().manual_seed(0)
    # Values and old values of different magnitudes: v - old is inexact, then so is old + (v - old).
    values = torch.randn(64, 256, generator=g) * 0.2
    old = torch.randn(64, 256, generator=g) * 0.2 * torch.rand(64, 256, generator=g) ** 4
    old = torch.where((values - old).abs() < 0.5, old, values)  # every step inside the range
    returns = torch.randn(64, 256, generator=g)
    mask = torch.ones(64, 256)
    # The rounding is real: some sums differ from v in float32.
    assert ((old + (values - old)) != values).any()
    out = value_loss(values, old, returns, mask, cliprange_value=0.5)
    assert out.metrics["critic/vf_clip_frac"] == 0.0
    assert out.loss.item() == value_loss(values, old, returns, mask, cliprange_value=None).loss.item()


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_loop(kind, mode):
    gen = torch.Generator().manual_seed(43)
    mask = make_mask(kind, 8, 6, gen)
    old = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    values = old + torch.randn(8, 6, generator=gen, dtype=torch.float64)
    returns = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    want = torch.zeros(8, 6, dtype=torch.float64)
    for b in range(8):
        for t in valid_positions(mask[b]):
            v, o, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            v_clip = o + min(max(v - o, -0.3), 0.3)
            want[b, t] = 0.5 * max((v - r) ** 2, (v_clip - r) ** 2)
    out = value_loss(poison_padding(values, mask), poison_padding(old, mask), poison_padding(returns, mask),
                     mask, cliprange_value=0.3, loss_agg_mode=mode)
    assert out.loss.item() == pytest.approx(aggregate_loss(want, mask, mode).item())


# ---------------------------------------------------------------- registry


def test_policy_loss_registry():
    assert get_policy_loss("ppo") is ppo_clip_loss
    assert get_policy_loss("gspo") is gspo_loss
    with pytest.raises(KeyError, match="'gpso'; nearest registered: 'gspo'"):
        get_policy_loss("gpso")


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_registered_policy_losses_share_one_signature(name):
    logp, old, adv, mask = random_policy_batch("right", seed=44)
    logp.requires_grad_(True)
    out = get_policy_loss(name)(log_probs=logp, old_log_probs=old, advantages=adv, mask=mask,
                                clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                loss_agg_mode="seq-mean-token-mean", denominator=None)
    loss, metrics = out
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(logp.grad).all() and logp.grad.abs().sum() > 0
    assert set(metrics) == {"actor/pg_loss", "actor/clip_frac", "actor/dual_clip_frac", "actor/approx_kl"}
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["actor/approx_kl"] > 0


# ---------------------------------------------------------------- off-policy correction (issue 40)


def _gap():
    """prox / behaviour log-probs of two sequences (row 1 has one padding token, poisoned with -inf)."""
    prox = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 1.0]], dtype=torch.float64))
    behav = torch.log(torch.tensor([[0.25, 0.4, 0.3], [0.3, 0.1, 1.0]], dtype=torch.float64))
    behav[1, 2] = -math.inf
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return prox, behav, mask


def test_behaviour_weights_token_level_by_hand():
    from hybridflow.algos import behaviour_weights

    prox, behav, mask = _gap()
    raw = torch.tensor([[2.0, 0.5, 3.0], [1.0, 6.0, 0.0]], dtype=torch.float64)  # pi_prox / pi_behaviour
    dec = behaviour_weights(prox, behav, mask, "decoupled")
    torch.testing.assert_close(dec.weights, raw)
    assert not dec.clipped.any()
    tis = behaviour_weights(prox, behav, mask, "tis", threshold=2.5)
    torch.testing.assert_close(tis.weights, torch.tensor([[2.0, 0.5, 2.5], [1.0, 2.5, 0.0]], dtype=torch.float64))
    assert tis.clipped.tolist() == [[False, False, True], [False, True, False]]
    mis = behaviour_weights(prox, behav, mask, "mis", threshold=2.5)
    torch.testing.assert_close(mis.weights, torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    assert mis.clipped.tolist() == tis.clipped.tolist()
    none = behaviour_weights(prox, behav, mask, "none")
    torch.testing.assert_close(none.weights, mask.to(torch.float64))


def test_behaviour_weights_sequence_level_is_the_product_of_token_ratios():
    from hybridflow.algos import behaviour_weights

    prox, behav, mask = _gap()
    seq = behaviour_weights(prox, behav, mask, "tis", level="sequence", threshold=4.0)
    # row 0: 2 * 0.5 * 3 = 3 (kept), row 1: 1 * 6 = 6 (padding left out) -> truncated at 4
    torch.testing.assert_close(seq.raw, torch.tensor([[3.0, 3.0, 3.0], [6.0, 6.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(seq.weights, torch.tensor([[3.0, 3.0, 3.0], [4.0, 4.0, 0.0]], dtype=torch.float64))
    mis = behaviour_weights(prox, behav, mask, "mis", level="sequence", threshold=4.0)
    torch.testing.assert_close(mis.weights, torch.tensor([[3.0, 3.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="level"):
        behaviour_weights(prox, behav, mask, "tis", level="batch")
    with pytest.raises(ValueError, match="correction"):
        behaviour_weights(prox, behav, mask, "is")


def test_behaviour_metrics_report_the_weights_and_the_k3_gap():
    from hybridflow.algos import behaviour_metrics

    prox, behav, mask = _gap()
    m = behaviour_metrics(prox, behav, mask, "tis", threshold=2.5)
    assert m["offpolicy/is_weight_mean"] == pytest.approx((2 + 0.5 + 3 + 1 + 6) / 5)
    assert m["offpolicy/is_weight_max"] == pytest.approx(6.0)
    assert m["offpolicy/is_clipped_frac"] == pytest.approx(2 / 5)
    # k3 of KL(behaviour || prox) per token: r - 1 - log r with r = pi_prox / pi_behaviour
    k3 = [r - 1 - math.log(r) for r in (2, 0.5, 3, 1, 6)]
    assert m["offpolicy/k3_kl"] == pytest.approx(sum(k3) / 5)
    same = behaviour_metrics(prox, prox, mask, "mis")
    assert same["offpolicy/k3_kl"] == 0.0 and same["offpolicy/is_weight_max"] == 1.0


@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_token_weights_scale_each_tokens_loss_and_gradient(name):
    """Weights w: the loss is aggregate(w * per-token loss); unit weights give the unweighted loss exactly."""
    torch.manual_seed(0)
    loss_fn = get_policy_loss(name)
    old = torch.randn(3, 5, dtype=torch.float64)
    adv = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    logp = leaf((old + 0.05 * torch.randn(3, 5, dtype=torch.float64)).tolist())
    plain = loss_fn(logp, old, adv, mask)
    ones = loss_fn(logp, old, adv, mask, token_weights=torch.ones(3, 5, dtype=torch.float64))
    assert ones.loss.item() == plain.loss.item()  # the same arithmetic: x * 1 == x
    w = torch.rand(3, 5, dtype=torch.float64) * 2
    weighted = loss_fn(logp, old, adv, mask, token_weights=w)
    (g_w,) = torch.autograd.grad(weighted.loss, logp)
    # by hand: each row's (or token's) contribution scaled by its weight; a loop over tokens with w = one-hot
    want = sum(w[i, j].item() * torch.autograd.grad(
        loss_fn(logp, old, adv, mask, token_weights=torch.nn.functional.one_hot(
            torch.tensor(i * 5 + j), 15).view(3, 5).double()).loss, logp)[0]
        for i in range(3) for j in range(5) if mask[i, j])
    torch.testing.assert_close(g_w, want)
