"""DAPO's length rules on hand-built rows: the soft overlong penalty's values at the buffer's edges and
inside it, which responses the limit cut, and that the cut rows add nothing to the loss's gradient."""
from __future__ import annotations

import pytest
import torch

from hybridflow.algos import get_policy_loss, overlong_penalty, truncated_rows
from hybridflow.data import fields as F
from hybridflow.trainer.dapo import OverlongShaping, drop_truncated

EOS, STOP, PAD = 2, 7, 0


def test_penalty_is_zero_before_the_buffer_then_linear_to_minus_penalty_at_the_limit():
    # L_max = 20, buffer 4: free up to 16 tokens, then -1/4 per token, -1 at 20 (and held past it).
    lengths = torch.tensor([0, 1, 15, 16, 17, 18, 19, 20, 23])
    got = overlong_penalty(lengths, max_length=20, buffer=4, penalty=1.0)
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [v / 2 for v in got.tolist()]
    # A buffer as long as the limit starts the slope at length 0; one token long, only L_max pays.
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 10, 2.0).tolist() == [0.0, -1.0, -2.0]
    assert overlong_penalty(torch.tensor([8, 9, 10]), 10, 1, 1.0).tolist() == [0.0, 0.0, -1.0]
    for bad in (0, 21):
        with pytest.raises(ValueError, match="overlong buffer must be 1..20 tokens"):
            overlong_penalty(lengths, 20, bad, 1.0)


def test_shaping_lowers_the_score_the_advantage_reads_and_reports_it():
    batch = {F.RESPONSE_LENGTH: torch.tensor([3, 5, 6, 6]), F.SCORES: torch.tensor([1.0, 0.0, 1.0, 0.5]),
             F.OUTCOME_SCORES: torch.tensor([1.0, 0.0, 1.0, 0.0])}
    metrics = {}
    out = OverlongShaping(max_length=6, buffer=2, penalty=1.0)(batch, metrics)
    assert out[F.OUTCOME_SCORES].tolist() == [1.0, -0.5, 0.0, -1.0]
    assert out[F.SCORES].tolist() == [1.0, -0.5, 0.0, -0.5]
    assert metrics == {"dapo/overlong_penalty": -0.625, "dapo/overlong_fraction": 0.75}


def test_truncated_means_every_token_used_and_no_stop_token_last():
    r = torch.tensor([[5, 6, 8, 9],       # 4 of 4 tokens, no stop: cut
                      [5, 6, 8, EOS],     # ends on EOS at the limit: finished
                      [5, STOP, PAD, PAD],  # stopped early
                      [5, 6, 8, STOP],    # another stop id at the limit: finished
                      [5, EOS, 8, 9]])    # EOS inside, then more tokens: cut (as the mask says)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    assert truncated_rows(r, mask, 4, (EOS, STOP)).tolist() == [True, False, False, False, True]
    assert truncated_rows(r, mask, 4, (EOS,)).tolist() == [True, False, False, True, True]
    assert truncated_rows(r, mask, 5, (EOS,)).tolist() == [False] * 5  # none used 5 tokens


def _loss_grad(logp_leaf, rows, mask, batch):
    """Gradient on the whole batch's log-probs of PPO's token-mean loss over `rows` of it, with `mask`."""
    logp = logp_leaf[rows]
    loss = get_policy_loss("ppo")(logp, batch["old"][rows], batch[F.ADVANTAGES][rows], mask,
                                  clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean").loss
    (grad,) = torch.autograd.grad(loss, logp_leaf)
    return grad


def test_dropped_truncated_rows_add_no_gradient_and_the_rest_divide_by_the_kept_tokens():
    g = torch.Generator().manual_seed(0)
    rows, width = 6, 5
    mask = torch.ones(rows, width)
    mask[1, 3:] = 0  # a short row
    cut = torch.tensor([False, True, False, True, False, False])
    mask[cut] = 1.0  # the cut rows use every token
    logp = (torch.randn(rows, width, generator=g) * 0.1 - 1.0).requires_grad_()
    batch = {"old": logp.detach() + torch.randn(rows, width, generator=g) * 0.05,
             F.ADVANTAGES: torch.randn(rows, width, generator=g), F.TRUNCATED: cut,
             "row": torch.arange(rows), F.RESPONSE_MASK: mask}
    metrics = {}
    kept = drop_truncated(batch, metrics)
    assert kept["row"].tolist() == [0, 2, 4, 5] and metrics == {"dapo/truncated_fraction": pytest.approx(2 / 6)}
    dropped = _loss_grad(logp, kept["row"], kept[F.RESPONSE_MASK], batch)
    assert dropped[cut].abs().max() == 0
    # The same gradient as zeroing the cut rows' response mask: a zeroed row leaves the token-mean's count too.
    zeroed = _loss_grad(logp, torch.arange(rows), mask * (~cut)[:, None], batch)
    torch.testing.assert_close(dropped, zeroed, rtol=0, atol=1e-7)
    # Counting the cut rows' tokens instead would shrink the step by the kept share of tokens.
    diluted = get_policy_loss("ppo")(logp, batch["old"], batch[F.ADVANTAGES], mask * (~cut)[:, None],
                                     clip_ratio_low=0.2, clip_ratio_high=0.28, denominator=mask.sum()).loss
    (diluted,) = torch.autograd.grad(diluted, logp)
    share = (mask * (~cut)[:, None]).sum() / mask.sum()
    torch.testing.assert_close(diluted, dropped * share, rtol=1e-5, atol=1e-7)


def test_clip_higher_leaves_room_to_raise_an_unlikely_token():
    """DAPO's clip-higher (actor.clip_ratio_high): with a positive advantage a token's probability may rise
    to (1 + high) times the old one before its gradient stops; the low side stays at 1 - low."""
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.25, 1.30, 0.85]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    for high, moving in ((0.2, [False, False, True]), (0.28, [True, False, True])):
        loss = get_policy_loss("ppo")(logp, old, adv, torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=high).loss
        (grad,) = torch.autograd.grad(loss, logp)
        assert (grad[0] != 0).tolist() == moving, high
