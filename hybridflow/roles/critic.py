"""The critic role: per-token values and the clipped value update."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hybridflow.algos import value_loss
from hybridflow.config.schema import CriticConfig
from hybridflow.data import fields as F
from hybridflow.roles.batching import (forward_only, mean_metrics, planned_mini_batches, response_slice,
                                       one_replica_steps, train_mini_batch, update_plan)
from hybridflow.common import mix_seed

UPDATE_FIELDS = (F.INPUT_IDS, F.ATTENTION_MASK, F.RESPONSES, F.RESPONSE_MASK, F.VALUES, F.RETURNS)
VALUE_FIELDS = (F.INPUT_IDS, F.ATTENTION_MASK, F.RESPONSES, F.RESPONSE_MASK)
_SHUFFLE_OFFSET = 17  # the critic draws its mini-batches apart from the actor's


def critic_update_plan(cfg: CriticConfig, mini_batch_size: int, seed: int, step: int, rows: int,
                       replicas: int) -> list[list[Tensor]]:
    """The critic's mini-batches at `step` (`data.batch.mini_batch_plan`): plan[replica][optimizer step]."""
    return update_plan(rows, mini_batch_size, cfg.ppo_epochs, replicas, mix_seed(seed, step) + _SHUFFLE_OFFSET)


class Critic:
    """Values V(s_t) for the state before each response token; engine built with value_head=True."""

    def __init__(self, cfg: CriticConfig, engine, *, mini_batch_size: int, seed: int = 0):
        if not engine.value_head:
            raise ValueError("the critic needs an engine built with value_head=True")
        self.cfg, self.engine = cfg, engine
        self.mini_batch_size, self.seed = mini_batch_size, seed

    @torch.no_grad()
    def compute_values(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """VALUES [B, R], zero on padding."""
        def collect(out, mb):
            return {F.VALUES: response_slice(out, mb).float() * mb[F.RESPONSE_MASK]}
        return forward_only(self.engine, batch, self.cfg.ppo_micro_batch_size, collect, self._max_tokens(),
                            self.cfg.share_prompts)

    def _max_tokens(self) -> int:
        return self.cfg.ppo_max_token_len_per_gpu if self.cfg.use_dynamic_bsz else 0

    def plan(self, rows: int, step: int, replicas: int = 1) -> list[list[Tensor]]:
        return critic_update_plan(self.cfg, self.mini_batch_size, self.seed, step, rows, replicas)

    def update(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        """Value-loss epochs over this process's rows (the whole update's: one replica)."""
        return self.update_share(batch, one_replica_steps(self, batch, step))

    def update_share(self, batch: dict[str, Any], steps: list[Tensor]) -> dict[str, float]:
        """One optimizer step per entry of `steps`, on this replica's share of that global mini-batch
        (see `Actor.update_share`)."""
        cfg = self.cfg
        data = {k: batch[k] for k in UPDATE_FIELDS}
        reports = [train_mini_batch(self.engine, mini, cfg.ppo_micro_batch_size, cfg.loss_agg_mode, self._loss,
                                    "critic", summed=("critic/vf_loss",), max_tokens=self._max_tokens(),
                                    share_prompts=cfg.share_prompts)
                   for mini in planned_mini_batches(data, steps)]
        return mean_metrics(reports)

    def _loss(self, out: Tensor, mb: dict[str, Tensor], denom: Tensor) -> tuple[Tensor, dict[str, Any]]:
        values = response_slice(out, mb).float()
        vl = value_loss(values, mb[F.VALUES], mb[F.RETURNS], mb[F.RESPONSE_MASK],
                        cliprange_value=self.cfg.cliprange_value, loss_agg_mode=self.cfg.loss_agg_mode,
                        denominator=denom)
        return vl.loss, dict(vl.metrics)  # critic/vf_loss is checked to be finite after the pass
