"""Advantage estimators against hand-computed cases and per-element loop references."""
import statistics

import pytest
import torch

from hybridflow.algos import (ADV_ESTIMATORS, AdvantageInputs, compute_advantages,
                              discounted_returns, gae, grpo, reinforce_plus_plus,
                              reinforce_plus_plus_baseline, remax, rloo)
from tests.algos.helpers import MASK_KINDS, make_mask, poison_padding, valid_positions

# ---------------------------------------------------------------- loop references
# Each removes the padding of a row, runs the textbook recursion on what is
# left, and writes the results back to the valid positions.


def gae_loop(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        ts = valid_positions(mask[b])
        next_v, next_a = 0.0, 0.0
        for t in reversed(ts):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            next_a = delta + gamma * lam * next_a
            next_v = values[b, t].item()
            adv[b, t] = next_a
    return adv, torch.where(mask.bool(), adv + values, torch.zeros_like(adv))


def returns_loop(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        g = 0.0
        for t in reversed(valid_positions(mask[b])):
            g = rewards[b, t].item() + gamma * g
            out[b, t] = g
    return out


def group_members(groups, i):
    return [j for j in range(len(groups)) if groups[j] == groups[i]]


def grpo_loop(scores, groups, norm_by_std, eps):
    out = []
    for i in range(len(scores)):
        vals = [scores[j] for j in group_members(groups, i)]
        if len(vals) == 1 or len(set(vals)) == 1:
            out.append(0.0)
            continue
        centered = scores[i] - statistics.fmean(vals)
        out.append(centered / (statistics.stdev(vals) + eps) if norm_by_std else centered)
    return out


def rloo_loop(scores, groups):
    out = []
    for i in range(len(scores)):
        others = [scores[j] for j in group_members(groups, i) if j != i]
        out.append(scores[i] - statistics.fmean(others) if others else 0.0)
    return out


def broadcast_loop(per_seq, mask):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in valid_positions(mask[b]):
            out[b, t] = per_seq[b]
    return out


def whiten_loop(x, mask):
    vals = [x[b, t].item() for b in range(x.shape[0]) for t in valid_positions(mask[b])]
    mean, std = statistics.fmean(vals), statistics.stdev(vals)
    return torch.where(mask.bool(), (x - mean) / std, torch.zeros_like(x))


def random_batch(kind, seed, batch=9, length=7):
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(kind, batch, length, gen)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return rewards, values, mask


def assert_close(a, b, atol=1e-9):
    torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=1e-7)


# ---------------------------------------------------------------- GAE and returns


def test_gae_hand():
    # gamma 0.9, lam 0.8, r = [0, 0, 1], V = [0.5, 0.4, 0.2]:
    # d2 = 1 - 0.2 = 0.8                  A2 = 0.8
    # d1 = 0.9*0.2 - 0.4 = -0.22          A1 = -0.22 + 0.72*0.8   = 0.356
    # d0 = 0.9*0.4 - 0.5 = -0.14          A0 = -0.14 + 0.72*0.356 = 0.11632
    adv, ret = gae(token_rewards=torch.tensor([[0.0, 0.0, 1.0]]), values=torch.tensor([[0.5, 0.4, 0.2]]),
                   mask=torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.11632, 0.356, 0.8]]))
    torch.testing.assert_close(ret, torch.tensor([[0.61632, 0.756, 1.0]]))


def test_gae_hole_is_skipped_not_a_step():
    # The same row with a tool token (reward 7, value 9) inside: the valid
    # tokens must get exactly the numbers above, the hole 0.
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(token_rewards=torch.tensor([[0.0, 7.0, 0.0, 1.0, 3.0]]),
                   values=torch.tensor([[0.5, 9.0, 0.4, 0.2, 5.0]]), mask=mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.11632, 0.0, 0.356, 0.8, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.61632, 0.0, 0.756, 1.0, 0.0]]))


def test_gae_length_one_and_empty_rows():
    adv, ret = gae(token_rewards=torch.tensor([[2.0, 5.0], [1.0, 1.0]]),
                   values=torch.tensor([[0.5, 3.0], [4.0, 4.0]]),
                   mask=torch.tensor([[1, 0], [0, 0]]), gamma=0.99, lam=0.95)
    assert adv.tolist() == [[1.5, 0.0], [0.0, 0.0]]  # A = r - V for a single token
    assert ret.tolist() == [[2.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.7), (0.5, 0.0)])
def test_gae_matches_loop(kind, gamma, lam):
    rewards, values, mask = random_batch(kind, seed=10)
    want_adv, want_ret = gae_loop(rewards, values, mask, gamma, lam)
    adv, ret = gae(token_rewards=poison_padding(rewards, mask), values=poison_padding(values, mask),
                   mask=mask, gamma=gamma, lam=lam)
    assert_close(adv, want_adv)
    assert_close(ret, want_ret)


def test_gae_lambda_one_is_monte_carlo_return_minus_value():
    rewards, values, mask = random_batch("holes", seed=11)
    adv, ret = gae(token_rewards=rewards, values=values, mask=mask, gamma=0.8, lam=1.0)
    mc = returns_loop(rewards, mask, 0.8)
    assert_close(ret, mc)
    assert_close(adv, torch.where(mask.bool(), mc - values, torch.zeros_like(mc)))


def test_gae_bool_mask_and_float32():
    rewards, values, mask = random_batch("right", seed=12)
    want, _ = gae_loop(rewards, values, mask, 0.9, 0.9)
    adv, _ = gae(token_rewards=rewards.float(), values=values.float(), mask=mask.bool(), gamma=0.9, lam=0.9)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, want.float(), atol=1e-5, rtol=1e-5)


def test_discounted_returns_hand():
    # r = [1, _, 0, 2] with a hole, gamma 0.5: G = [1 + 0.5*(0 + 0.5*2), 0, 0 + 0.5*2, 2]
    got = discounted_returns(torch.tensor([[1.0, 9.0, 0.0, 2.0]]), torch.tensor([[1, 0, 1, 1]]), gamma=0.5)
    assert got.tolist() == [[1.5, 0.0, 1.0, 2.0]]


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_discounted_returns_matches_loop(kind):
    rewards, _, mask = random_batch(kind, seed=13)
    got = discounted_returns(poison_padding(rewards, mask), mask, 0.93)
    assert_close(got, returns_loop(rewards, mask, 0.93))


# ---------------------------------------------------------------- group estimators


def test_grpo_hand_with_size_one_and_uniform_groups():
    # group a: [1, 0] -> mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> +-0.70711
    # group b: [1, 1] -> all equal -> 0;  group c: [0.5] alone -> 0
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    adv, ret = grpo(scores=scores, mask=mask, group_ids=["a", "a", "b", "b", "c"], eps=0.0)
    want = torch.tensor([[0.70711, 0.70711], [-0.70711, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)
    assert torch.equal(ret, adv)
    adv, _ = grpo(scores=scores, mask=mask, group_ids=["a", "a", "b", "b", "c"], norm_by_std=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]))


def test_grpo_uniform_group_is_exactly_zero_despite_rounding():
    # In float32 the mean of [0.9] * 3 is 0.9 + 6e-8 (and of [0.3] * 7,
    # 0.3 - 3e-8): the residue over its own tiny std would be a spurious advantage.
    scores = torch.tensor([0.9] * 3 + [0.3] * 7)
    assert (scores[:3] - scores[:3].sum() / 3).abs().max() > 0  # the premise
    for norm_by_std in (True, False):
        adv, _ = grpo(scores=scores, mask=torch.ones(10, 3), group_ids=torch.tensor([0] * 3 + [1] * 7),
                      norm_by_std=norm_by_std)
        assert torch.equal(adv, torch.zeros(10, 3))
    adv, _ = rloo(scores=scores, mask=torch.ones(10, 3), group_ids=torch.tensor([0] * 3 + [1] * 7))
    assert torch.equal(adv, torch.zeros(10, 3))


def random_groups(seed, batch=12):
    gen = torch.Generator().manual_seed(seed)
    # sizes 4, 3, 1, 2, 2 with the last group tied
    groups = [0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 4]
    scores = torch.randn(batch, generator=gen, dtype=torch.float64)
    scores[10] = scores[11] = 0.25
    perm = torch.randperm(batch, generator=gen)
    return scores[perm], [groups[i] for i in perm.tolist()], gen


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(kind, norm_by_std):
    scores, groups, gen = random_groups(20)
    mask = make_mask(kind, 12, 5, gen)
    adv, _ = grpo(scores=scores, mask=mask, group_ids=torch.tensor(groups), norm_by_std=norm_by_std, eps=1e-6)
    want = grpo_loop(scores.tolist(), groups, norm_by_std, 1e-6)
    assert_close(adv, broadcast_loop(want, mask))


def test_group_ids_as_strings_tensor_or_list_agree():
    scores, groups, _ = random_groups(21)
    mask = torch.ones(12, 2)
    a, _ = grpo(scores=scores, mask=mask, group_ids=torch.tensor(groups) * 7 - 3)
    b, _ = grpo(scores=scores, mask=mask, group_ids=[f"uid-{g}" for g in groups])
    c, _ = grpo(scores=scores, mask=mask, group_ids=groups)
    assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="group_ids has 11 entries for 12 scores"):
        grpo(scores=scores, mask=mask, group_ids=groups[:-1])


def test_rloo_hand():
    # group [1, 0, 3]: 1 - mean(0, 3) = -0.5; 0 - mean(1, 3) = -2; 3 - mean(1, 0) = 2.5
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, _ = rloo(scores=torch.tensor([1.0, 0.0, 3.0, 4.0]), mask=mask, group_ids=[5, 5, 5, 6])
    torch.testing.assert_close(adv, torch.tensor([[-0.5, -0.5], [-2.0, -2.0], [2.5, 0.0], [0.0, 0.0]]))


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_rloo_matches_loop(kind):
    scores, groups, gen = random_groups(22)
    mask = make_mask(kind, 12, 5, gen)
    adv, _ = rloo(scores=scores, mask=mask, group_ids=groups)
    assert_close(adv, broadcast_loop(rloo_loop(scores.tolist(), groups), mask))


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_reinforce_plus_plus_matches_loop(kind):
    rewards, _, mask = random_batch(kind, seed=23)
    adv, ret = reinforce_plus_plus(token_rewards=poison_padding(rewards, mask), mask=mask, gamma=0.9)
    want_ret = returns_loop(rewards, mask, 0.9)
    assert_close(ret, want_ret)
    assert_close(adv, whiten_loop(want_ret, mask), atol=1e-6)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_reinforce_plus_plus_baseline_matches_loop(kind):
    scores, groups, gen = random_groups(24)
    mask = make_mask(kind, 12, 5, gen)
    adv, _ = reinforce_plus_plus_baseline(scores=scores, mask=mask, group_ids=groups)
    centered = [scores[i].item() - statistics.fmean(scores[j].item() for j in group_members(groups, i))
                for i in range(12)]
    assert_close(adv, whiten_loop(broadcast_loop(centered, mask), mask), atol=1e-6)


def test_remax_hand():
    adv, ret = remax(scores=torch.tensor([1.0, 0.2]), baseline_scores=torch.tensor([0.5, 0.5]),
                     mask=torch.tensor([[1, 1, 0], [1, 0, 0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.3, 0.0, 0.0]]))
    assert torch.equal(ret, adv)
    with pytest.raises(ValueError, match="baseline_scores must have shape"):
        remax(scores=torch.tensor([1.0, 0.2]), baseline_scores=torch.tensor([0.5]), mask=torch.ones(2, 3))


def test_remax_registered_subtracts_each_prompts_greedy_score_by_hand():
    """Two prompts x 3 samples, through the registry as the trainer calls it: each sample's score minus
    its prompt's greedy score (the baseline repeated over the prompt's rows), on its valid tokens only."""
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    baseline = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # prompt 0's greedy answer right, prompt 1's wrong
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1]])
    adv, ret = compute_advantages("remax", AdvantageInputs(mask=mask, scores=scores, baseline_scores=baseline,
                                                           group_ids=["0"] * 3 + ["1"] * 3))
    want = torch.tensor([[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0],
                         [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    assert torch.equal(adv, want) and torch.equal(ret, want)  # 1 - 1, 0 - 1, 0 - 0, 1 - 0: exact in float
    with pytest.raises(ValueError, match="'remax' needs AdvantageInputs.baseline_scores"):
        compute_advantages("remax", AdvantageInputs(mask=mask, scores=scores))


# ---------------------------------------------------------------- registry


def full_inputs(kind, seed, **kw):
    rewards, values, mask = random_batch(kind, seed, batch=12, length=5)
    scores, groups, _ = random_groups(seed)
    return AdvantageInputs(mask=mask, token_rewards=poison_padding(rewards, mask), scores=scores,
                           values=poison_padding(values, mask), group_ids=groups,
                           baseline_scores=scores.flip(0), gamma=0.9, lam=0.8, **kw)


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_every_estimator_is_zero_at_padding_and_finite(name, kind):
    x = full_inputs(kind, seed=30)
    adv, ret = compute_advantages(name, x)
    assert adv.shape == ret.shape == x.mask.shape
    pad = ~x.mask.bool()
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[pad] == 0).all() and (ret[pad] == 0).all()
    assert adv[~pad].abs().sum() > 0  # and not trivially zero everywhere


def test_registry_entries_call_the_functions():
    x = full_inputs("holes", seed=31)
    raw_adv, raw_ret = gae(token_rewards=x.token_rewards, values=x.values, mask=x.mask, gamma=0.9, lam=0.8)
    adv, ret = compute_advantages("gae", x)
    assert torch.equal(ret, raw_ret)  # critic targets are not whitened
    assert_close(adv, whiten_loop(raw_adv, x.mask), atol=1e-6)
    adv, _ = compute_advantages("gae", AdvantageInputs(**{**x.__dict__, "whiten_advantages": False}))
    assert torch.equal(adv, raw_adv)
    want, _ = grpo(scores=x.scores, mask=x.mask, group_ids=x.group_ids, norm_by_std=False)
    unnormed = AdvantageInputs(**{**x.__dict__, "norm_by_std": False})
    assert torch.equal(compute_advantages("grpo", unnormed)[0], want)


def test_outcome_scores_default_to_sum_of_token_rewards():
    x = full_inputs("right", seed=32)
    summed = torch.where(x.mask.bool(), x.token_rewards, torch.zeros_like(x.token_rewards)).sum(-1)
    without_scores = AdvantageInputs(**{**x.__dict__, "scores": None})
    want, _ = rloo(scores=summed, mask=x.mask, group_ids=x.group_ids)
    assert_close(compute_advantages("rloo", without_scores)[0], want)


def test_missing_input_is_named():
    x = AdvantageInputs(mask=torch.ones(2, 2), token_rewards=torch.ones(2, 2))
    with pytest.raises(ValueError, match="'gae' needs AdvantageInputs.values"):
        compute_advantages("gae", x)
    with pytest.raises(ValueError, match="'grpo' needs AdvantageInputs.group_ids"):
        compute_advantages("grpo", x)
    with pytest.raises(ValueError, match="needs AdvantageInputs.scores or AdvantageInputs.token_rewards"):
        compute_advantages("rloo", AdvantageInputs(mask=torch.ones(2, 2), group_ids=[0, 0]))
