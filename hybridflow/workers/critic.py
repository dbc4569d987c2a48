"""The critic role: per-token values and the clipped value update."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hybridflow.algos import value_loss
from hybridflow.config.schema import CriticConfig
from hybridflow.data import fields as F
from hybridflow.workers.actor import check_finite, forward_only
from hybridflow.workers.batching import (global_count, mean_metrics, response_slice, shuffled, split,
                                         summed_share)

_TRAIN_FIELDS = (F.INPUT_IDS, F.ATTENTION_MASK, F.RESPONSES, F.RESPONSE_MASK, F.VALUES, F.RETURNS)


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
        return forward_only(self.engine, batch, self.cfg.ppo_micro_batch_size, collect)

    def update(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        cfg, dp = self.cfg, self.engine.layout.dp
        data = {k: batch[k] for k in _TRAIN_FIELDS}
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 17)
        size = max(1, self.mini_batch_size // dp)
        reports = []
        for _ in range(cfg.ppo_epochs):
            for mini in split(shuffled(data, gen), size):
                denom = global_count(mini[F.RESPONSE_MASK], cfg.loss_agg_mode, ps.get_data_parallel_group())
                micro = split(mini, cfg.ppo_micro_batch_size)
                scale = len(micro) * dp

                def step_fn(out: Tensor, mb: dict[str, Tensor]):
                    values = response_slice(out, mb).float()
                    vl = value_loss(values, mb[F.VALUES], mb[F.RETURNS], mb[F.RESPONSE_MASK],
                                    cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode,
                                    denominator=denom)
                    check_finite("critic/vf_loss", vl.loss.item())
                    return vl.loss * scale, dict(vl.metrics)

                self.engine.zero_grad()
                micro_reports = self.engine.run(micro, step_fn)
                stats = self.engine.step()
                check_finite("critic/grad_norm", stats.grad_norm)
                report = mean_metrics(micro_reports)
                report["critic/vf_loss"] = summed_share(micro_reports, "critic/vf_loss", ps.get_data_parallel_group())
                report.update({"critic/grad_norm": stats.grad_norm, "critic/lr": stats.lr})
                reports.append(report)
        return mean_metrics(reports)
