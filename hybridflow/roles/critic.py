"""The critic role: per-token values and the clipped value update."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hybridflow.algos import value_loss
from hybridflow.config.schema import CriticConfig
from hybridflow.data import fields as F
from hybridflow.roles.batching import forward_only, mean_metrics, mini_batches, response_slice, train_mini_batch
from hybridflow.utils import mix_seed

_TRAIN_FIELDS = (F.INPUT_IDS, F.ATTENTION_MASK, F.RESPONSES, F.RESPONSE_MASK, F.VALUES, F.RETURNS)
_SHUFFLE_OFFSET = 17  # the critic shuffles its mini-batches apart from the actor's


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

    def update(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        """Value-loss epochs over mini-batches (one optimizer step each) of this rank's rows."""
        cfg = self.cfg
        data = {k: batch[k] for k in _TRAIN_FIELDS}
        gen = torch.Generator().manual_seed(mix_seed(self.seed, step) + _SHUFFLE_OFFSET)
        size = max(1, self.mini_batch_size // self.engine.layout.dp)
        reports = [train_mini_batch(self.engine, mini, cfg.ppo_micro_batch_size, cfg.loss_agg_mode, self._loss,
                                    "critic", summed=("critic/vf_loss",), max_tokens=self._max_tokens(),
                                    share_prompts=cfg.share_prompts)
                   for mini in mini_batches(data, size, cfg.ppo_epochs, gen)]
        return mean_metrics(reports)

    def _loss(self, out: Tensor, mb: dict[str, Tensor], denom: Tensor) -> tuple[Tensor, dict[str, Any]]:
        values = response_slice(out, mb).float()
        vl = value_loss(values, mb[F.VALUES], mb[F.RETURNS], mb[F.RESPONSE_MASK],
                        cliprange_value=self.cfg.cliprange_value, loss_agg_mode=self.cfg.loss_agg_mode,
                        denominator=denom)
        return vl.loss, dict(vl.metrics)  # critic/vf_loss is checked to be finite after the pass
