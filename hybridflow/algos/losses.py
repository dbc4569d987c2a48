"""Policy and value losses: per-token terms, aggregated to a scalar.

Shapes: B sequences, T response tokens; `mask[B, T]` marks the tokens that
are trained on. Every loss returns `LossOutput(loss, metrics)` (a NamedTuple,
so `loss, metrics = ppo_clip_loss(...)` works): `loss` is a differentiable
scalar, `metrics` plain floats under stable names ("actor/clip_frac", ...).

Registered policy losses share one keyword signature, so
`actor.policy_loss` selects one by name:
    fn(log_probs, old_log_probs, advantages, mask, *, clip_ratio_low,
       clip_ratio_high, clip_ratio_c, loss_agg_mode, denominator,
       token_weights=None) -> LossOutput

`token_weights[B, T]` (no gradient) scale each token's loss before it is
aggregated: the off-policy correction (`behaviour_weights`), whose clip stays
around `old_log_probs` (the proximal policy) while the samples came from the
behaviour policy that generated them.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from hybridflow.algos._registry import lookup, make_register
from hybridflow.algos.aggregate import Denominator, aggregate_loss
from hybridflow.algos.kl import kl_k3
from hybridflow.kernels.masked import as_bool, masked_fill_zero, masked_mean

# Beyond this the ratio is meaningless and exp() would overflow float32.
_MAX_LOG_RATIO = 20.0


class LossOutput(NamedTuple):
    loss: Tensor  # scalar, differentiable
    metrics: dict[str, float]


PolicyLoss = Callable[..., LossOutput]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
register_policy_loss = make_register(POLICY_LOSSES, "policy loss")


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss (signature in the module docstring); KeyError if unknown."""
    return lookup(POLICY_LOSSES, name, "policy loss")


def _log_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    # Padding may hold -inf log-probs; select before anything is exponentiated.
    return masked_fill_zero(log_probs - old_log_probs, mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _frac(flags: Tensor, mask: Tensor) -> float:
    return masked_mean(flags.float(), mask).item()


class ClipTerms(NamedTuple):
    """Per-token pieces of a clipped surrogate, each [B, T]."""

    loss_mat: Tensor  # per-token loss, 0 at padding
    clipped: Tensor  # bool: the clipped branch is the active one
    dual_clipped: Tensor  # bool: the dual-clip bound is the active one


def clipped_surrogate(ratio: Tensor, advantages: Tensor, mask: Tensor, clip_ratio_low: float,
                      clip_ratio_high: float, clip_ratio_c: Optional[float] = None) -> ClipTerms:
    """PPO's clipped objective per token, as a loss (to minimise).

    ratio, advantages, mask: [B, T]. loss = max(-A r, -A clip(r, 1-low, 1+high)).
    Dual clip (Ye et al. 2020), only where A < 0: loss = min(loss, -A c), so a
    huge ratio on a bad token cannot produce an unbounded update.
    """
    adv = masked_fill_zero(advantages, mask)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        bound = -adv * clip_ratio_c
        dual_active = (adv < 0) & (bound < loss)
        loss = torch.where(dual_active, bound, loss)
    valid = as_bool(mask)
    return ClipTerms(masked_fill_zero(loss, mask), clip_active & valid, dual_active & valid)


def _policy_output(terms: ClipTerms, log_ratio: Tensor, mask: Tensor, loss_agg_mode: str,
                   denominator: Denominator, token_weights: Optional[Tensor] = None) -> LossOutput:
    loss_mat = terms.loss_mat if token_weights is None else terms.loss_mat * token_weights.detach()
    loss = aggregate_loss(loss_mat, mask, loss_agg_mode, denominator)
    with torch.no_grad():
        # k3 estimate of KL(pi_old || pi) from the rollout's samples:
        # (r - 1) - log r with r = pi / pi_old, never negative.
        approx_kl = masked_mean(kl_k3(torch.zeros_like(log_ratio), log_ratio), mask).item()
        metrics = {
            "actor/pg_loss": loss.item(),
            "actor/clip_frac": _frac(terms.clipped, mask),
            "actor/dual_clip_frac": _frac(terms.dual_clipped, mask),
            "actor/approx_kl": approx_kl,
        }
    return LossOutput(loss, metrics)


@register_policy_loss("ppo")
def ppo_clip_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
                  clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                  clip_ratio_c: Optional[float] = 3.0, loss_agg_mode: str = "token-mean",
                  denominator: Denominator = None, token_weights: Optional[Tensor] = None) -> LossOutput:
    """PPO clipped surrogate with asymmetric bounds and the dual clip.

    log_probs (differentiable), old_log_probs, advantages, mask: [B, T].
    Per-token ratio r = exp(logp - old); the clip range is [1 - low, 1 + high]
    (a larger `high`, as in DAPO's clip-higher, leaves room to raise unlikely
    tokens). clip_ratio_c > 1 is the dual clip on negative advantages; the
    default 3.0 is `actor.clip_ratio_c`'s (and verl's), and None turns it off.
    Where a clip is active the token's gradient is exactly 0.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, mask)
    terms = clipped_surrogate(log_ratio.exp(), advantages, mask, clip_ratio_low,
                              clip_ratio_high, clip_ratio_c)
    return _policy_output(terms, log_ratio, mask, loss_agg_mode, denominator, token_weights)


@register_policy_loss("gspo")
def gspo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4,
              clip_ratio_c: Optional[float] = None, loss_agg_mode: str = "seq-mean-token-mean",
              denominator: Denominator = None, token_weights: Optional[Tensor] = None) -> LossOutput:
    """GSPO (Zheng et al. 2025): one clipped importance ratio per sequence.

    log_probs (differentiable), old_log_probs, advantages, mask: [B, T].
    s_i = exp(mean over valid tokens of (logp - old)), clipped to
    [1 - low, 1 + high] for the whole sequence; the paper's ranges are
    ~1e-4, far tighter than token-level PPO. Written in the GSPO-token form:
    token t uses sg(s_i) * pi(y_t) / sg(pi(y_t)), whose value is s_i and
    whose gradient is s_i * grad log pi(y_t); with one advantage per sequence
    and "seq-mean-token-mean" (the paper's setting) this equals GSPO exactly,
    and it still accepts per-token advantages. clip_ratio_c is accepted for a
    uniform signature and not used (the paper has no dual clip).
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, mask)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)
    lp = masked_fill_zero(log_probs, mask)
    token_log_ratio = (seq_log_ratio.detach()[:, None] + lp - lp.detach()).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    terms = clipped_surrogate(token_log_ratio.exp(), advantages, mask, clip_ratio_low,
                              clip_ratio_high, None)
    return _policy_output(terms, log_ratio, mask, loss_agg_mode, denominator, token_weights)


# --------------------------------------------------------------------------- off-policy correction

CORRECTIONS = ("none", "decoupled", "tis", "mis")


class BehaviourWeights(NamedTuple):
    """The correction's per-token weights and where the threshold acted, each [B, T]."""

    weights: Tensor  # w (0 at padding): what each token's loss is multiplied by
    raw: Tensor  # w before truncation or masking (0 at padding)
    clipped: Tensor  # bool: the threshold truncated (tis) or masked (mis) this token's weight


def behaviour_weights(prox_log_probs: Tensor, behaviour_log_probs: Tensor, mask: Tensor, correction: str,
                      level: str = "token", threshold: float = 2.0) -> BehaviourWeights:
    """w = pi_prox / pi_behaviour per token ("token") or one per sequence ("sequence": the product of the
    sequence's token ratios, exp of their summed log ratio), shape [B, T] either way.

    prox_log_probs: the trainer's recomputed old log-probs (the proximal policy of decoupled PPO,
    Hilton et al. 2022 / AReaL); behaviour_log_probs: the sampler's (the weights, maybe versions behind,
    and the inference engine that generated the tokens). correction: "decoupled" keeps w as it is, "tis"
    truncates it at `threshold` (min(w, C)), "mis" masks it to 0 above `threshold`; "none" gives w = 1.
    No gradient flows through w (both inputs are fixed before the update).
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"off-policy correction must be one of {CORRECTIONS}, got {correction!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"off-policy correction level must be 'token' or 'sequence', got {level!r}")
    valid = as_bool(mask)
    log_w = _log_ratio(prox_log_probs.detach(), behaviour_log_probs.detach(), mask)
    if level == "sequence":
        log_w = masked_fill_zero(log_w.sum(-1, keepdim=True).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
                                 .expand_as(log_w), mask)
    raw = masked_fill_zero(log_w.exp(), mask)
    none = torch.zeros_like(valid)
    if correction == "none":
        return BehaviourWeights(valid.to(raw.dtype), raw, none)
    if correction == "decoupled":
        return BehaviourWeights(raw, raw, none)
    over = (raw > threshold) & valid
    weights = raw.clamp(max=threshold) if correction == "tis" else torch.where(over, torch.zeros_like(raw), raw)
    return BehaviourWeights(weights, raw, over)


@torch.no_grad()
def behaviour_metrics(prox_log_probs: Tensor, behaviour_log_probs: Tensor, mask: Tensor, correction: str,
                      level: str = "token", threshold: float = 2.0,
                      weights: Optional[BehaviourWeights] = None) -> dict[str, float]:
    """The sampler-trainer gap of a batch, over its response tokens: the importance weight pi_prox /
    pi_behaviour at `level` (mean, max, and the fraction the threshold truncated or masked under
    `correction`) and the k3 estimate of KL(pi_behaviour || pi_prox) from the sampled tokens. `weights`:
    what `behaviour_weights` gave for these same arguments, where the caller has it (not computed again)."""
    w = weights if weights is not None else behaviour_weights(prox_log_probs, behaviour_log_probs, mask,
                                                               correction, level, threshold)
    valid = as_bool(mask)
    k3 = kl_k3(behaviour_log_probs.float(), prox_log_probs.float())
    raw = w.raw[valid]
    return {
        "offpolicy/is_weight_mean": raw.mean().item() if raw.numel() else 1.0,
        "offpolicy/is_weight_max": raw.max().item() if raw.numel() else 1.0,
        "offpolicy/is_clipped_frac": _frac(w.clipped, mask),
        "offpolicy/k3_kl": masked_mean(k3, mask).item(),
    }


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               cliprange_value: Optional[float] = 0.5, loss_agg_mode: str = "token-mean",
               denominator: Denominator = None) -> LossOutput:
    """Clipped value loss: 0.5 * max((v - R)^2, (v_clip - R)^2).

    values (differentiable), old_values (from the rollout), returns, mask: [B, T].
    v_clip = old + clip(v - old, -cliprange_value, +cliprange_value): the
    critic gains nothing from moving further than the clip range in one
    update. cliprange_value=None disables clipping.
    """
    err = masked_fill_zero(values - returns, mask)
    unclipped = err ** 2
    if cliprange_value is None:
        loss_mat, clipped_flags = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        # Where |v - old| is inside the range, v_clip is v itself, not old + (v - old): that sum can
        # round away from v by an ulp and count an unclipped token as clipped.
        step = masked_fill_zero(values - old_values, mask)
        outside = step.abs() > cliprange_value
        v_clip = torch.where(outside, old_values + step.clamp(-cliprange_value, cliprange_value), values)
        clipped = masked_fill_zero(v_clip - returns, mask) ** 2
        loss_mat, clipped_flags = torch.maximum(unclipped, clipped), outside & (clipped > unclipped)
    loss = 0.5 * aggregate_loss(loss_mat, mask, loss_agg_mode, denominator)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": loss.item(),
            "critic/vf_clip_frac": _frac(clipped_flags, mask),
            "critic/vpred_mean": masked_mean(values, mask).item(),
        }
    return LossOutput(loss, metrics)
