"""The actor role: log-probs of the current policy and the PPO-family update."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hybridflow.algos import aggregate_loss, behaviour_metrics, behaviour_weights, get_policy_loss, kl_loss, masked_mean
from hybridflow.config.schema import ActorConfig
from hybridflow.data import fields as F
from hybridflow.algos.routes import route_metrics
from hybridflow.roles.batching import (forward_only, mean_metrics, planned_mini_batches, response_log_probs,
                                       one_replica_steps, train_mini_batch, update_plan)
from hybridflow.common import mix_seed

# The most an update reads; `update_fields` names what one reads.
UPDATE_FIELDS = (F.INPUT_IDS, F.ATTENTION_MASK, F.RESPONSES, F.RESPONSE_MASK, F.OLD_LOG_PROBS, F.ADVANTAGES,
                 F.REF_LOG_PROBS, F.ROLLOUT_LOG_PROBS, F.ROUTES, F.OLD_ROUTES)
# What a log-prob pass reads (an MoE rollout's ROUTES where it recorded them: measured, or replayed).
LOG_PROB_FIELDS = (F.INPUT_IDS, F.ATTENTION_MASK, F.RESPONSES, F.RESPONSE_MASK, F.ROUTES)


def update_fields(cfg: ActorConfig, old_log_probs: bool) -> tuple[str, ...]:
    """The fields an update reads, by what the stages before it did. `old_log_probs`: an old log-prob pass
    ran (`config.plan.needs_old_log_probs`), so OLD_LOG_PROBS is the proximal policy and the token stage
    measured the sampler-trainer gap; without it the loss takes its own log-probs, detached, and measures
    the gap against ROLLOUT_LOG_PROBS. REF_LOG_PROBS with the KL loss; ROLLOUT_LOG_PROBS with an off-policy
    correction too. ROUTES where the rollout recorded them; OLD_ROUTES when the update replays the old pass's."""
    wanted = {F.REF_LOG_PROBS: cfg.use_kl_loss, F.OLD_LOG_PROBS: old_log_probs,
              F.ROLLOUT_LOG_PROBS: cfg.off_policy_correction != "none" or not old_log_probs,
              F.OLD_ROUTES: cfg.moe.routing_replay == "old"}
    return tuple(k for k in UPDATE_FIELDS if wanted.get(k, True))


def actor_update_plan(cfg: ActorConfig, samples_per_prompt: int, seed: int, step: int, rows: int,
                      replicas: int) -> list[list[Tensor]]:
    """The actor's mini-batches at `step` (`data.batch.mini_batch_plan`): ppo_mini_batch_size prompts'
    responses each, ppo_epochs passes, drawn from (seed, step) alone; plan[replica][optimizer step]."""
    return update_plan(rows, cfg.ppo_mini_batch_size * samples_per_prompt, cfg.ppo_epochs, replicas,
                       mix_seed(seed, step))


class Actor:
    """Policy log-probs and updates on a training engine; the loss is chosen by name."""

    def __init__(self, cfg: ActorConfig, engine, *, samples_per_prompt: int = 1, temperature: float = 1.0,
                 seed: int = 0, old_log_probs: bool = True):
        self.cfg, self.engine = cfg, engine
        self.old_log_probs = old_log_probs  # whether an old log-prob pass runs before each update (`update_fields`)
        self.policy_loss = get_policy_loss(cfg.policy_loss)
        self.samples_per_prompt = samples_per_prompt
        self.temperature, self.seed = temperature, seed

    def log_probs(self, output: Tensor, mb: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return response_log_probs(output, mb, self.engine, self.temperature)

    @torch.no_grad()
    def compute_log_probs(self, batch: dict[str, Any], micro_batch_size: int,
                          max_tokens: int = 0, share_prompts: bool = False) -> dict[str, Tensor]:
        """OLD_LOG_PROBS and ENTROPY [B, R] under the current weights (max_tokens > 0: packed;
        share_prompts: each prompt computed once per micro-batch)."""
        def collect(out, mb):
            logp, ent = self.log_probs(out, mb)
            return {F.OLD_LOG_PROBS: logp.float(), F.ENTROPY: ent.float()}
        routes = self._routes(update=False)
        out = forward_only(self.engine, batch, micro_batch_size, collect, max_tokens, share_prompts)
        if routes is not None:  # ROUTE_MISMATCH (ROUTES measured), OLD_ROUTES (recorded)
            parts = routes.collect()
            out.update({k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {})
        return out

    def _routes(self, update: bool):
        """An MoE model's routing replay (`engine/routes.py`) set up for the old-log-prob pass or the update
        (actor.moe.routing_replay: "rollout" routes both by ROUTES; "old" records OLD_ROUTES in the old pass
        and routes the update by them); None without routers to replay (a dense model, the FSDP engine)."""
        routes = getattr(self.engine, "routes", None)
        if routes is None or not routes.active:
            return None
        mode = self.cfg.moe.routing_replay
        routes.target = F.ROUTES if mode == "rollout" else F.OLD_ROUTES if mode == "old" and update else None
        routes.record = mode == "old" and not update
        return routes

    def plan(self, rows: int, step: int, replicas: int = 1) -> list[list[Tensor]]:
        return actor_update_plan(self.cfg, self.samples_per_prompt, self.seed, step, rows, replicas)

    def update(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        """PPO epochs over this process's rows (the whole update's: one replica)."""
        return self.update_share(batch, one_replica_steps(self, batch, step))

    def update_share(self, batch: dict[str, Any], steps: list[Tensor]) -> dict[str, float]:
        """One optimizer step per entry of `steps`, on this replica's share of that global mini-batch
        (`steps[k]` indexes `batch`'s rows; -1 is a padding row, masked). The loss is normalised over the
        global mini-batch, so the replicas together take the one-process step."""
        cfg, reads = self.cfg, update_fields(self.cfg, self.old_log_probs)
        missing = [k for k in reads if k not in batch and k != F.ROUTES]  # ROUTES: where the rollout recorded them
        if missing:
            raise KeyError(f"the actor's update (old_log_probs={self.old_log_probs}, off_policy_correction="
                           f"{cfg.off_policy_correction!r}, use_kl_loss={cfg.use_kl_loss}) reads {missing}, "
                           "which the batch does not hold")
        data = {k: batch[k] for k in reads if k in batch}
        reports, routes = [], self._routes(update=True)
        for mini in planned_mini_batches(data, steps):
            reports.append(train_mini_batch(self.engine, mini, cfg.ppo_micro_batch_size, cfg.loss_agg_mode,
                                            self._loss, "actor", summed=("actor/pg_loss", "actor/kl_loss"),
                                            max_tokens=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else 0,
                                            share_prompts=cfg.share_prompts))
            if routes is not None and F.ROUTES in mini:  # the trainer's own experts against the sampler's
                mismatch = [p[F.ROUTE_MISMATCH] for p in routes.collect()]
                reports[-1].update({f"moe/{k}": v for k, v in
                                    route_metrics(torch.cat(mismatch)).items()} if mismatch else {})
        return mean_metrics(reports)

    def _loss(self, out: Tensor, mb: dict[str, Tensor], denom: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """One micro-batch's share of the mini-batch loss: policy loss, - entropy bonus, + KL loss."""
        cfg, mask = self.cfg, mb[F.RESPONSE_MASK]
        logp, ent = self.log_probs(out, mb)
        old = mb[F.OLD_LOG_PROBS] if self.old_log_probs else logp.detach()
        extra, metrics = {}, {}  # a user's registered loss without token_weights still runs uncorrected
        correction = (cfg.off_policy_correction, cfg.off_policy_correction_level, cfg.off_policy_correction_threshold)
        # No proximal pass ran (one optimizer step: `config.plan.needs_old_log_probs`): the sampler-trainer gap
        # is measured here, against this pass's log-probs, which are the proximal policy's.
        gap = not self.old_log_probs
        if cfg.off_policy_correction != "none" or gap:
            w = behaviour_weights(old, mb[F.ROLLOUT_LOG_PROBS], mask, *correction)
            if cfg.off_policy_correction != "none":  # the clip around the proximal policy (old), weighted to behaviour
                extra["token_weights"] = w.weights
            if gap:
                metrics.update(behaviour_metrics(old, mb[F.ROLLOUT_LOG_PROBS], mask, *correction, weights=w))
        pg = self.policy_loss(logp, old, mb[F.ADVANTAGES], mask,
                              clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                              clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode, denominator=denom,
                              **extra)
        loss = pg.loss
        metrics.update(pg.metrics)
        metrics["actor/entropy"] = masked_mean(ent, mask).item()
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * aggregate_loss(ent, mask, cfg.loss_agg_mode, denom)
        if cfg.use_kl_loss:
            kl = kl_loss(logp, mb[F.REF_LOG_PROBS], mask, cfg.kl_loss_type, cfg.loss_agg_mode, denom)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.item()
        metrics["actor/pg_loss"] = pg.loss.item()  # checked to be finite after the pass (train_mini_batch)
        return loss, metrics
