"""Masked reductions and loss aggregation: hand cases, loop references, NaN safety."""
import statistics

import pytest
import torch

from hybridflow.algos import (LOSS_AGG_MODES, aggregate_loss, masked_mean, masked_std, masked_var,
                              masked_whiten)
from tests.algos.helpers import MASK_KINDS, make_mask, poison_padding, valid_positions


def test_masked_mean_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(1.5)
    # the empty second row averages to 0, not NaN
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 0.0]))
    assert masked_mean(x, torch.zeros(2, 3)).item() == 0.0


def test_padding_with_inf_and_nan_does_not_leak():
    x = torch.tensor([[1.0, float("-inf")], [3.0, float("nan")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_var(x, mask).item() == pytest.approx(2.0)  # unbiased var of [1, 3]
    out = masked_whiten(x, mask)
    assert torch.isfinite(out).all()
    assert out[0, 1] == 0 and out[1, 1] == 0


def test_masked_whiten_hand():
    # [1, 2, 3]: mean 2, unbiased var 1 -> [-1, 0, 1]; padding stays 0.
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 50.0, 60.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_whiten(x, mask),
                               torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False),
                               torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masked_var_std_whiten_match_python_statistics(kind):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 9, generator=gen, dtype=torch.float64) * 3 + 1
    mask = make_mask(kind, 7, 9, gen)
    vals = [x[b, t].item() for b in range(7) for t in valid_positions(mask[b])]
    x = poison_padding(x, mask)
    assert masked_mean(x, mask).item() == pytest.approx(statistics.fmean(vals))
    assert masked_var(x, mask).item() == pytest.approx(statistics.variance(vals))
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(statistics.pvariance(vals))
    assert masked_std(x, mask).item() == pytest.approx(statistics.stdev(vals))
    mean, std = statistics.fmean(vals), statistics.stdev(vals)
    white = masked_whiten(x, mask, eps=0.0)
    for b in range(7):
        for t in range(9):
            want = (x[b, t].item() - mean) / std if mask[b, t] else 0.0
            assert white[b, t].item() == pytest.approx(want, abs=1e-9)


def test_single_valid_element_has_zero_variance():
    x = torch.tensor([[5.0, 1.0]])
    mask = torch.tensor([[1, 0]])
    assert masked_var(x, mask).item() == 0.0
    assert masked_whiten(x, mask).tolist() == [[0.0, 0.0]]


def _aggregate_loop(loss, mask, mode):
    rows = []
    for b in range(loss.shape[0]):
        ts = valid_positions(mask[b])
        if ts:
            rows.append([loss[b, t].item() for t in ts])
    if not rows:
        return 0.0
    if mode == "token-mean":
        flat = [v for r in rows for v in r]
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def test_aggregate_hand():
    # row sums 6 and 4, row means 2 and 4, 4 valid tokens; the empty third row
    # (full of large numbers) counts nowhere.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 70.0, 80.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(2.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_matches_loop(kind, mode):
    gen = torch.Generator().manual_seed(2)
    loss = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    mask = make_mask(kind, 8, 6, gen)
    got = aggregate_loss(poison_padding(loss, mask, float("inf")), mask, mode).item()
    assert got == pytest.approx(_aggregate_loop(loss, mask, mode))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_all_padding_is_zero_with_zero_grad(mode):
    loss = torch.full((3, 4), float("nan"), requires_grad=True)
    for denominator in (None, 0.0, torch.tensor(0.0)):
        loss.grad = None
        out = aggregate_loss(loss, torch.zeros(3, 4), mode, denominator=denominator)
        out.backward()
        assert out.item() == 0.0
        assert torch.equal(loss.grad, torch.zeros(3, 4))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_denominator_makes_micro_batches_add_up(mode):
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    mask = make_mask("holes", 8, 5, gen)
    full = aggregate_loss(loss, mask, mode).item()
    if mode == "token-mean":
        denom = mask.sum().item()
    else:
        denom = float((mask.sum(-1) > 0).sum())
    parts = [aggregate_loss(loss[i:i + 3], mask[i:i + 3], mode, denominator=denom).item() for i in range(0, 8, 3)]
    assert sum(parts) == pytest.approx(full)
    # the local count would weigh the micro-batches wrongly
    local = [aggregate_loss(loss[i:i + 3], mask[i:i + 3], mode).item() for i in range(0, 8, 3)]
    assert sum(local) / 3 != pytest.approx(full)


def test_aggregate_unknown_mode_names_nearest():
    with pytest.raises(KeyError, match="token_mean.*nearest registered: 'token-mean'"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "token_mean")
