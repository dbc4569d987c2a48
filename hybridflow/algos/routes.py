"""The route mismatch of a mixture-of-experts model's pass, from F.ROUTE_MISMATCH (engine/routes.py measures it:
per INPUT_IDS column, the share of layers whose experts the trainer chose otherwise than the sampler, -1 where
not measured): how often, and what it does to the sampler-trainer log-prob gap."""
from __future__ import annotations

from torch import Tensor

__all__ = ["log_prob_gaps", "route_metrics"]


def route_metrics(mismatch: Tensor) -> dict[str, float]:
    """The route mismatch of a pass (F.ROUTE_MISMATCH [..., S]: per column the share of layers whose experts the
    trainer chose otherwise than the sampler, -1 where not measured): "route_mismatch", the share of (token,
    layer) pairs routed otherwise; "route_mismatch_tokens", the share of tokens with at least one such layer.
    {} when nothing was measured."""
    measured = mismatch[mismatch >= 0]
    if not measured.numel():
        return {}
    return {"route_mismatch": float(measured.mean()), "route_mismatch_tokens": float((measured > 0).float().mean())}


def log_prob_gaps(mismatch: Tensor, trainer: Tensor, sampler: Tensor, response_mask: Tensor) -> dict[str, float]:
    """The sampler-trainer log-prob gap, mean |trainer - sampler| over response tokens [B, R], apart for tokens
    predicted at a column some layer routed otherwise (mismatch: F.ROUTE_MISMATCH [B, T+R]; the logits of
    response token j come from column T + j - 1) and for the others: "route_mismatch_log_prob_gap",
    "route_match_log_prob_gap" (each where such tokens exist)."""
    r = response_mask.shape[1]
    predicting = mismatch[:, -r - 1:-1]
    mask = response_mask.bool() & (predicting >= 0)
    gap = (trainer - sampler).abs()
    out = {}
    for name, where in (("route_mismatch_log_prob_gap", mask & (predicting > 0)),
                        ("route_match_log_prob_gap", mask & (predicting == 0))):
        if where.any():
            out[name] = float(gap[where].mean())
    return out
