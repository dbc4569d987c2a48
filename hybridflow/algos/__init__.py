"""RL algorithms as small pure functions on [B, T] tensors, selected by name.

- advantages.py: GAE, GRPO, RLOO, REINFORCE++(-baseline), ReMax; ADV_ESTIMATORS
- losses.py: PPO clip (asymmetric, dual clip), GSPO, clipped value loss; POLICY_LOSSES; the off-policy
  correction's behaviour weights (decoupled PPO, TIS, MIS)
- kl.py: k1/k2/k3/abs estimators, KL reward penalty and loss, KL controllers; KL_ESTIMATORS
- aggregate.py: token-mean / seq-mean-token-sum / seq-mean-token-mean
- metrics.py: float statistics for logging
- overlong.py: DAPO's length rules: the soft overlong penalty and which responses the limit cut
- masked reductions (masked_mean, masked_whiten, ...): re-exported from kernels/masked.py, where
  the GAE kernel's fused whitening finds its reference (kernels are the layer below; docs/design.md)
"""
from hybridflow.algos.advantages import (ADV_ESTIMATORS, AdvantageInputs, compute_advantages,
                                         discounted_returns, gae, get_adv_estimator, grpo,
                                         group_stats, register_adv_estimator, reinforce_plus_plus,
                                         reinforce_plus_plus_baseline, remax, rloo)
from hybridflow.algos.aggregate import LOSS_AGG_MODES, aggregate_loss
from hybridflow.algos.kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController,
                                 apply_kl_penalty, build_kl_controller, get_kl_estimator,
                                 kl_loss, kl_penalty, register_kl_estimator)
from hybridflow.algos.losses import (CORRECTIONS, POLICY_LOSSES, BehaviourWeights, LossOutput,
                                     behaviour_metrics, behaviour_weights, get_policy_loss, gspo_loss,
                                     ppo_clip_loss, register_policy_loss, value_loss)
from hybridflow.algos.overlong import overlong_penalty, truncated_rows
from hybridflow.algos.metrics import (advantage_stats, approx_kl, clip_fraction, entropy_mean,
                                      explained_variance, masked_stats)
from hybridflow.kernels.masked import masked_mean, masked_std, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS", "AdvantageInputs", "compute_advantages", "discounted_returns", "gae",
    "get_adv_estimator", "grpo", "group_stats", "register_adv_estimator", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "remax", "rloo",
    "LOSS_AGG_MODES", "aggregate_loss",
    "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "apply_kl_penalty",
    "build_kl_controller", "get_kl_estimator", "kl_loss", "kl_penalty", "register_kl_estimator",
    "POLICY_LOSSES", "LossOutput", "get_policy_loss", "gspo_loss", "ppo_clip_loss",
    "register_policy_loss", "value_loss", "CORRECTIONS", "BehaviourWeights", "behaviour_metrics",
    "behaviour_weights",
    "masked_mean", "masked_std", "masked_sum", "masked_var", "masked_whiten",
    "advantage_stats", "approx_kl", "clip_fraction", "entropy_mean", "explained_variance",
    "masked_stats", "overlong_penalty", "truncated_rows",
]
