"""Advantage estimators: per-token advantages and returns from rewards.

Shapes: B sequences, T response tokens. `mask[B, T]` marks real response
tokens; padding is usually on the right but may also sit in the middle (tool
output inside a multi-turn response). Every estimator returns
`(advantages[B, T], returns[B, T])`, exactly 0 at masked positions.

Two ways in:
- the functions themselves (`gae(token_rewards=..., values=..., ...)`), with
  only the arguments each needs;
- the registry: `compute_advantages(name, AdvantageInputs(...))`, one calling
  convention for all, so `algorithm.adv_estimator` picks one by name. Each
  registered estimator reads the fields it needs, says which one is missing,
  and ignores the rest.

Outcome-reward estimators (GRPO, RLOO, REINFORCE++-baseline, ReMax) score a
whole sequence. Their `returns` equal their advantages: nothing regresses on
them, they are only logged.

Where the group estimators deliberately differ from verl's (0.9; equal elsewhere):
- a group of one sample gets advantage 0. verl's GRPO uses mean 0 and std 1
  there, so the raw score becomes the advantage: a lone sample would be pushed
  by its absolute reward, with nothing to compare it against;
- a group whose scores are all equal gets exactly 0, even with eps = 0. verl
  divides (s - rounded mean) by (0 + eps), which can turn a rounding residue
  into a large advantage;
- masked positions are exactly 0 (verl: also 0, by multiplying with the mask;
  here NaN or inf in a masked position stays out as well).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence, Union

import torch
from torch import Tensor

from hybridflow import kernels
from hybridflow.algos._registry import lookup, make_register
from hybridflow.kernels.masked import as_bool, masked_fill_zero, masked_sum, masked_whiten

GroupIds = Union[Tensor, Sequence[Hashable]]
Estimator = Callable[["AdvantageInputs"], tuple[Tensor, Tensor]]

ADV_ESTIMATORS: dict[str, Estimator] = {}
register_adv_estimator = make_register(ADV_ESTIMATORS, "advantage estimator")


def get_adv_estimator(name: str) -> Estimator:
    """The registered estimator `fn(AdvantageInputs) -> (adv, ret)`; KeyError if unknown."""
    return lookup(ADV_ESTIMATORS, name, "advantage estimator")


def _float(x: Tensor) -> Tensor:
    # Scans and group statistics in bf16 lose the small differences that
    # advantages are made of; compute in at least float32.
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ---------------------------------------------------------------- token-level scans


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go G_t = r_t + gamma * G_next over the valid tokens of each row.

    token_rewards, mask: [B, T] -> returns [B, T], 0 at masked positions.
    Masked steps are skipped, not treated as zero-reward steps: the result on
    the valid tokens equals the scan over the row with its padding removed.
    """
    return kernels.discounted_returns(token_rewards, mask, gamma)


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
        lam: float, whiten: bool = False) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016).

    token_rewards, values, mask: [B, T] -> (advantages[B, T], returns[B, T]).
    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next,
    where "next" is the next *valid* token of the row (V_next = A_next = 0
    after the last one). Masked steps are skipped with the next value and
    advantage carried across them, so holes in the mask (tool tokens) neither
    contribute nor cut the recursion. returns = advantages + values.
    whiten=True whitens the advantages over the batch's valid tokens
    (`masked_whiten`; fused into the C++ scan on CPU); returns stay raw.
    """
    # The scan itself lives in kernels/ (C++ on CPU, reference loop elsewhere).
    return kernels.gae(token_rewards, values, mask, gamma, lam, whiten=whiten)


# ---------------------------------------------------------------- groups of samples


def group_index(group_ids: GroupIds, device: Optional[torch.device] = None) -> tuple[Tensor, int]:
    """Dense group index [B] in 0..G-1, and G.

    group_ids: a [B] integer tensor, or any length-B sequence of hashables
    (prompt uids as strings, say). Equal ids form one group.
    """
    if isinstance(group_ids, Tensor):
        if group_ids.numel() == 0:
            return torch.zeros(0, dtype=torch.long, device=device), 0
        _, idx = torch.unique(group_ids, return_inverse=True)
        return idx.to(device), int(idx.max()) + 1
    table: dict[Hashable, int] = {}
    idx = [table.setdefault(g, len(table)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long, device=device), len(table)


@dataclass(frozen=True)
class GroupStats:
    """Per-sequence statistics of its group, each [B]."""

    size: Tensor
    centered: Tensor  # score - group mean; exactly 0 for size-1 and all-equal groups
    std: Tensor  # unbiased (Bessel) group std; 0 for groups of size 1


def group_stats(scores: Tensor, group_ids: GroupIds) -> GroupStats:
    """Group size, centred score and std for every sequence. scores: [B]."""
    s = _float(scores)
    if len(group_ids) != s.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {s.shape[0]} scores")
    idx, n_groups = group_index(group_ids, s.device)

    def per_group_sum(x: Tensor) -> Tensor:
        return torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add_(0, idx, x)

    size = per_group_sum(torch.ones_like(s))
    mean = per_group_sum(s) / size
    centered = s - mean[idx]
    var = per_group_sum(centered ** 2) / (size - 1).clamp(min=1)
    hi = torch.full_like(size, -torch.inf).scatter_reduce(0, idx, s, "amax")
    lo = torch.full_like(size, torch.inf).scatter_reduce(0, idx, s, "amin")
    # A rounded mean need not equal identical scores exactly, and dividing that
    # residue by a zero std would turn it into a large advantage.
    no_signal = (hi == lo)[idx]
    centered = torch.where(no_signal, torch.zeros_like(centered), centered)
    return GroupStats(size=size[idx], centered=centered, std=var.sqrt()[idx])


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    """[B] -> [B, T]: the sequence value on its valid tokens, 0 elsewhere."""
    return masked_fill_zero(per_seq[:, None].expand(mask.shape), mask)


def _check_scores(scores: Tensor, mask: Tensor, name: str = "scores") -> None:
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"{name} must have shape [B]={[mask.shape[0]]}, got {list(scores.shape)}")


def grpo(scores: Tensor, mask: Tensor, group_ids: GroupIds, norm_by_std: bool = True,
         eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): outcome score normalised within its group.

    scores: [B]; mask: [B, T]; group_ids: [B] -> (advantages, returns) [B, T].
    A_i = (s_i - mean_g) / (std_g + eps) (or without the division when
    norm_by_std=False, as in Dr. GRPO), on every valid token of sequence i.
    std is the unbiased group std. A group of size 1, or one whose scores are
    all equal, has no signal to compare against: its advantage is 0.
    """
    _check_scores(scores, mask)
    st = group_stats(scores, group_ids)
    adv = st.centered
    if norm_by_std:
        # Groups without signal have centered == 0 and std == 0: keep them 0
        # even when eps is 0.
        adv = torch.where(st.std > 0, adv / (st.std + eps), torch.zeros_like(adv))
    adv = _broadcast(adv, mask)
    return adv, adv


def rloo(scores: Tensor, mask: Tensor, group_ids: GroupIds) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024).

    scores: [B]; mask: [B, T]; group_ids: [B] -> (advantages, returns) [B, T].
    A_i = s_i - mean of the *other* scores in i's group = n/(n-1) * (s_i - mean_g).
    Groups of size 1 have no other sample: advantage 0.
    """
    _check_scores(scores, mask)
    st = group_stats(scores, group_ids)
    scale = st.size / (st.size - 1).clamp(min=1)
    adv = _broadcast(st.centered * scale, mask)
    return adv, adv


def reinforce_plus_plus(token_rewards: Tensor, mask: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go, whitened over the batch.

    token_rewards, mask: [B, T] -> (advantages, returns) [B, T], where returns
    are the discounted reward-to-go and advantages their batch whitening.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


def reinforce_plus_plus_baseline(scores: Tensor, mask: Tensor,
                                 group_ids: GroupIds) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: group-mean baseline, then batch whitening.

    scores: [B]; mask: [B, T]; group_ids: [B] -> (advantages, returns) [B, T].
    (s_i - mean_g) on every valid token, whitened over all valid tokens of the
    batch (the batch std, not the group std, sets the scale).
    """
    _check_scores(scores, mask)
    adv = masked_whiten(_broadcast(group_stats(scores, group_ids).centered, mask), mask)
    return adv, adv


def remax(scores: Tensor, baseline_scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): the greedy rollout's score as the baseline.

    scores, baseline_scores: [B]; mask: [B, T] -> (advantages, returns) [B, T].
    A_i = s_i - b_i on every valid token of sequence i, where b_i is the score
    of the greedy response to i's prompt (the same b for all n samples of a
    prompt). The trainer runs that greedy rollout, one per prompt, when
    `algorithm.adv_estimator=remax` (`trainer.RLTrainer._baseline`). Unlike
    the group estimators it needs no second sample: n = 1 has a signal.
    """
    _check_scores(scores, mask)
    _check_scores(baseline_scores, mask, "baseline_scores")
    adv = _broadcast(_float(scores) - _float(baseline_scores), mask)
    return adv, adv


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything any registered estimator may read; each takes what it needs.

    mask: [B, T] valid response tokens.
    token_rewards: [B, T] per-token rewards (outcome reward on the last valid
        token, minus a KL penalty when it is in the reward).
    scores: [B] outcome score per sequence. Outcome estimators use it when
        given, else the sum of the valid token_rewards, so pass only
        token_rewards when a KL penalty has been folded into them.
    values: [B, T] critic values (GAE).
    group_ids: [B] prompt of each sample (GRPO, RLOO, REINFORCE++-baseline).
    baseline_scores: [B] greedy-rollout scores (ReMax).
    gamma, lam: discount and GAE lambda.
    norm_by_std: GRPO divides by the group std.
    whiten_advantages: GAE whitens its advantages over the batch (its returns,
        the critic's targets, are left as they are).
    """

    mask: Tensor
    token_rewards: Optional[Tensor] = None
    scores: Optional[Tensor] = None
    values: Optional[Tensor] = None
    group_ids: Optional[GroupIds] = None
    baseline_scores: Optional[Tensor] = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    whiten_advantages: bool = True

    def need(self, field: str, estimator: str):
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}")
        return value

    def outcome_scores(self, estimator: str) -> Tensor:
        if self.scores is not None:
            return self.scores
        if self.token_rewards is None:
            raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.scores "
                             "or AdvantageInputs.token_rewards")
        return masked_sum(_float(self.token_rewards), self.mask, dim=-1)


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Run the estimator registered as `name`: -> (advantages[B, T], returns[B, T])."""
    return get_adv_estimator(name)(inputs)


@register_adv_estimator("gae")
def _gae_entry(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return gae(token_rewards=x.need("token_rewards", "gae"), values=x.need("values", "gae"),
               mask=x.mask, gamma=x.gamma, lam=x.lam, whiten=x.whiten_advantages)


@register_adv_estimator("grpo")
def _grpo_entry(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return grpo(scores=x.outcome_scores("grpo"), mask=x.mask,
                group_ids=x.need("group_ids", "grpo"), norm_by_std=x.norm_by_std)


@register_adv_estimator("rloo")
def _rloo_entry(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return rloo(scores=x.outcome_scores("rloo"), mask=x.mask, group_ids=x.need("group_ids", "rloo"))


@register_adv_estimator("reinforce_plus_plus")
def _reinforce_pp_entry(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return reinforce_plus_plus(token_rewards=x.need("token_rewards", "reinforce_plus_plus"),
                               mask=x.mask, gamma=x.gamma)


@register_adv_estimator("reinforce_plus_plus_baseline")
def _reinforce_pp_baseline_entry(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    name = "reinforce_plus_plus_baseline"
    return reinforce_plus_plus_baseline(scores=x.outcome_scores(name), mask=x.mask,
                                        group_ids=x.need("group_ids", name))


@register_adv_estimator("remax")
def _remax_entry(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return remax(scores=x.outcome_scores("remax"), baseline_scores=x.need("baseline_scores", "remax"), mask=x.mask)
