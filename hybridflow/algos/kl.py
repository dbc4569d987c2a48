"""KL estimators between the policy and a reference, and the KL-coefficient controllers.

Log-probs are those of the sampled tokens, so each estimator is a per-token
Monte-Carlo estimate of KL(pi || pi_ref) from samples of pi (Schulman,
"Approximating KL divergence", 2020). With d = ref - logp:
  k1  = -d                          unbiased, can be negative
  k2  = 0.5 * d^2        ("mse")    biased, low variance, >= 0
  k3  = exp(d) - d - 1   ("low_var_kl") unbiased, >= 0, low variance
  abs = |d|
The KL is used either as a reward penalty (`apply_kl_penalty`, coefficient
from a controller) or as a loss term (`kl_loss`).
"""
from __future__ import annotations

from typing import Callable, Union

import torch
from torch import Tensor

from hybridflow.algos._registry import lookup, make_register
from hybridflow.algos.aggregate import Denominator, aggregate_loss
from hybridflow.kernels.masked import as_bool, masked_fill_zero, masked_mean

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {}
register_kl_estimator = make_register(KL_ESTIMATORS, "KL estimator")

# exp() of a log-ratio beyond this overflows float32 (and its gradient becomes
# inf * 0 = NaN once the result is clamped); 20 is far past any useful ratio.
_MAX_LOG_RATIO = 20.0
# k3 grows exponentially in the log-ratio; a handful of tokens whose
# probability collapsed would otherwise dominate the batch KL.
_K3_BOUND = 10.0


def get_kl_estimator(name: str) -> KLEstimator:
    """The registered `fn(log_probs, ref_log_probs) -> kl` (elementwise); KeyError if unknown."""
    return lookup(KL_ESTIMATORS, name, "KL estimator")


@register_kl_estimator("k1")
def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """logp - ref, elementwise."""
    return log_probs - ref_log_probs


@register_kl_estimator("k2")
@register_kl_estimator("mse")
def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """0.5 * (logp - ref)^2, elementwise."""
    return 0.5 * (log_probs - ref_log_probs) ** 2


@register_kl_estimator("k3")
@register_kl_estimator("low_var_kl")
def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10], elementwise."""
    d = (ref_log_probs - log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(d) - d - 1).clamp(-_K3_BOUND, _K3_BOUND)


@register_kl_estimator("abs")
def kl_abs(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """|logp - ref|, elementwise."""
    return (log_probs - ref_log_probs).abs()


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of kind "k1", "k2"/"mse", "k3"/"low_var_kl" or "abs".

    log_probs, ref_log_probs: [B, T] -> [B, T]. Padding is not masked here.
    """
    return get_kl_estimator(kind)(log_probs, ref_log_probs)


def apply_kl_penalty(token_rewards: Tensor, log_probs: Tensor, ref_log_probs: Tensor,
                     mask: Tensor, kl_coef: float, kind: str = "k1") -> tuple[Tensor, float]:
    """Fold a KL penalty into the rewards: r_t - kl_coef * kl_t on valid tokens.

    token_rewards, log_probs, ref_log_probs, mask: [B, T] ->
    (new_rewards[B, T] with 0 at padding, mean_kl). mean_kl is the mean over
    non-empty sequences of each sequence's token-mean KL: the quantity an
    adaptive controller is steered on. No gradient flows: rewards are data.
    """
    with torch.no_grad():
        kl = masked_fill_zero(kl_penalty(log_probs, ref_log_probs, kind), mask)
        new_rewards = masked_fill_zero(token_rewards - kl_coef * kl, mask)
        per_seq = masked_mean(kl, mask, dim=-1)
        nonempty = as_bool(mask).any(-1)
        mean_kl = masked_mean(per_seq, nonempty).item()
    return new_rewards, mean_kl


def kl_loss(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, kind: str = "low_var_kl",
            loss_agg_mode: str = "token-mean", denominator: Denominator = None) -> Tensor:
    """KL to the reference as a differentiable loss term (scalar).

    log_probs, ref_log_probs, mask: [B, T]; aggregated by `aggregate_loss`.
    """
    kl = masked_fill_zero(kl_penalty(log_probs, ref_log_probs, kind), mask)
    return aggregate_loss(kl, mask, loss_agg_mode, denominator)


# ---------------------------------------------------------------- controllers


class FixedKLController:
    """A constant KL coefficient; `update` is accepted and ignored."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards `target_kl`.

    Ziegler et al. 2019: e = clip(current_kl / target_kl - 1, -0.2, 0.2);
    value <- value * (1 + e * n_steps / horizon). The clip bounds how fast the
    coefficient moves on one noisy KL measurement; n_steps is the number of
    samples (or steps) the measurement covers, so `horizon` is in those units.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"need target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = Union[FixedKLController, AdaptiveKLController]


def build_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1,
                        horizon: int = 10000) -> KLController:
    """"fixed" or "adaptive" controller starting at kl_coef (fields of algorithm.kl_ctrl)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; expected 'fixed' or 'adaptive'")
