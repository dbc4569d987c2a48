"""The actor role: log-probs of the current policy and the PPO-family update."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from hybridflow.algos import aggregate_loss, get_policy_loss, kl_loss, masked_mean
from hybridflow.config.schema import ActorConfig
from hybridflow.data import fields as F
from hybridflow.workers.batching import (global_count, mean_metrics, response_log_probs, shuffled, split,
                                         summed_share, tensor_fields)

_TRAIN_FIELDS = (F.INPUT_IDS, F.ATTENTION_MASK, F.RESPONSES, F.RESPONSE_MASK, F.OLD_LOG_PROBS, F.ADVANTAGES)


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm became NaN/inf; names the metric."""

    def __init__(self, metric: str, value: float):
        super().__init__(f"{metric} is {value}")
        self.metric, self.value = metric, value


def check_finite(metric: str, value: float) -> None:
    if not math.isfinite(value):
        raise NonFiniteError(metric, value)


def forward_only(engine, batch: dict[str, Any], micro_batch_size: int, collect) -> dict[str, Tensor]:
    """Run `collect(output, micro_batch) -> {field: tensor}` over micro-batches, concatenated."""
    micro = split(tensor_fields(batch), micro_batch_size)
    reports = engine.run(micro, lambda out, mb: (out.new_zeros(()), collect(out, mb)), forward_only=True)
    return {k: torch.cat([r[k] for r in reports]) for k in reports[0]} if reports else {}


class Actor:
    """Policy log-probs and updates on a training engine; the loss is chosen by name."""

    def __init__(self, cfg: ActorConfig, engine, *, samples_per_prompt: int = 1, temperature: float = 1.0,
                 kernel_backend: str = "auto", seed: int = 0):
        self.cfg, self.engine = cfg, engine
        self.policy_loss = get_policy_loss(cfg.policy_loss)  # an unknown name fails at build time
        self.samples_per_prompt = samples_per_prompt
        self.temperature, self.backend, self.seed = temperature, kernel_backend, seed

    def log_probs(self, output: Tensor, mb: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return response_log_probs(output, mb, self.engine, self.temperature, self.backend)

    @torch.no_grad()
    def compute_log_probs(self, batch: dict[str, Any], micro_batch_size: int) -> dict[str, Tensor]:
        """OLD_LOG_PROBS and ENTROPY [B, R] under the current weights."""
        def collect(out, mb):
            logp, ent = self.log_probs(out, mb)
            return {F.OLD_LOG_PROBS: logp.float(), F.ENTROPY: ent.float()}
        return forward_only(self.engine, batch, micro_batch_size, collect)

    def _mini_batch_size(self, rows: int) -> int:
        dp = self.engine.layout.dp
        size = self.cfg.ppo_mini_batch_size * self.samples_per_prompt // dp
        return max(1, min(size, rows))

    def update(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        """PPO epochs over mini-batches (one optimizer step each) of this rank's rows."""
        fields = _TRAIN_FIELDS + ((F.REF_LOG_PROBS,) if self.cfg.use_kl_loss else ())
        data = {k: batch[k] for k in fields}
        rows = len(data[F.INPUT_IDS])
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        reports = []
        for _ in range(self.cfg.ppo_epochs):
            for mini in split(shuffled(data, gen), self._mini_batch_size(rows)):
                reports.append(self._train_mini_batch(mini))
        return mean_metrics(reports)

    def _train_mini_batch(self, mini: dict[str, Tensor]) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        cfg, dp = self.cfg, self.engine.layout.dp
        denom = global_count(mini[F.RESPONSE_MASK], cfg.loss_agg_mode, ps.get_data_parallel_group())
        micro = split(mini, cfg.ppo_micro_batch_size)
        # Megatron divides by the number of micro-batches and DDP averages over
        # DP ranks; both are undone so the gradient is that of the global mean.
        scale = len(micro) * dp

        def step_fn(out: Tensor, mb: dict[str, Tensor]):
            mask = mb[F.RESPONSE_MASK]
            logp, ent = self.log_probs(out, mb)
            pg = self.policy_loss(logp, mb[F.OLD_LOG_PROBS], mb[F.ADVANTAGES], mask,
                                  clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                                  clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
                                  denominator=denom)
            loss, metrics = pg.loss, dict(pg.metrics)
            ent_share = aggregate_loss(ent, mask, cfg.loss_agg_mode, denom)
            metrics["actor/entropy"] = masked_mean(ent, mask).item()
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * ent_share
            if cfg.use_kl_loss:
                kl = kl_loss(logp, mb[F.REF_LOG_PROBS], mask, cfg.kl_loss_type, cfg.loss_agg_mode, denom)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["actor/kl_loss"] = kl.item()
            metrics["actor/pg_loss"] = pg.loss.item()
            check_finite("actor/pg_loss", metrics["actor/pg_loss"])
            return loss * scale, metrics

        self.engine.zero_grad()
        reports = self.engine.run(micro, step_fn)
        stats = self.engine.step()
        check_finite("actor/grad_norm", stats.grad_norm)
        out = mean_metrics(reports)
        # The per-micro-batch loss is a share of the mini-batch loss: sum, not mean.
        for key in ("actor/pg_loss", "actor/kl_loss"):
            if key in out:
                out[key] = summed_share(reports, key, ps.get_data_parallel_group())
        out.update({"actor/grad_norm": stats.grad_norm, "actor/lr": stats.lr})
        return out
