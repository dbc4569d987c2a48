"""The PPO/GRPO trainer: the single controller's loop, as the algorithm reads.

    for step in steps:
        batch, metrics, flow = prepare(step)   # DataFlow per prompt chunk: [greedy baseline] -> rollout
                                               #   -> reward -> [reference] -> old log-probs -> [values];
                                               # then the whole batch: [KL in reward] -> advantages (in the
                                               #   actor's rank 0) -> [drop uniform groups]
        stats = update(batch, step)            # critic, then actor PPO epochs

The models live in worker groups (`hybridflow.workers.rl_workers`, built by
`trainer/build.py`, in-process or as Ray actors on the devices `placement`
gives each role): the actor, its rollout and the reference share one group
(the hybrid layout); the critic has its own. Rollout may have a group of its
own (placement.rollout != placement.training), fed the actor's shards by
collectives, and with `trainer.off_policy` generating ahead of the update.
Which route the weights take is one object chosen when the trainer is built
(`self.weights`, `hybrid_engine/rollout_weights.py`); the loop drives it the
same way for all. Under Ray (trainer.data_plane=object_store) no token tensor
([B, R] and wider) or text a worker makes passes through this process: the
driver holds placeholders and one number a row, and its own stages are held
to that in-process too (`workers/driver_rows.py`). The rule reward scores
where the rows are made (`roles.scoring`); the token-level preparation runs
in the actor's rank 0 (`roles.preparation`). Which stages run is decided once,
when the trainer is built. Checkpoints hold each engine's shard and the step;
data order and sampling seeds are functions of (seed, step), so a resumed run
repeats an uninterrupted one exactly.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from hybridflow.algos import build_kl_controller
from hybridflow.config.loader import to_dict
from hybridflow.config.inputs import check_prompt_count, load_model_config, load_reward_function, load_tokenizer
from hybridflow.config.plan import RunPlan
from hybridflow.config.preflight import check_runnable
from hybridflow.config.schema import Config
from hybridflow.config.validate import needs_decoder
from hybridflow.controller.dispatch import PerReplica, concat_batches, method_reads
from hybridflow.controller.worker import DIED, WorkerError
from hybridflow.dataflow import DataFlow, Node, NodeError
from hybridflow.dataflow.off_policy import staleness_metrics
from hybridflow.data import fields as F
from hybridflow.data.batch import chunk_rows, rows_for_plan, select_fields, take_rows
from hybridflow.data.dataset import PromptDataset
from hybridflow.data.sampler import PromptSampler
from hybridflow.roles.actor import actor_update_plan, update_fields
from hybridflow.roles.critic import critic_update_plan
from hybridflow.roles.preparation import READS as PREPARATION_READS
from hybridflow.roles.preparation import TokenStage
from hybridflow.roles.scoring import RewardError, reward_counts, score_with_config
from hybridflow.roles.rollout import BASELINE, TRAIN, VALIDATION, row_figures
from hybridflow.trainer import rl_steps as S
from hybridflow.checkpoint.base import lora_base
from hybridflow.checkpoint.format import trainer_state
from hybridflow.checkpoint.manager import CheckpointManager
from hybridflow.workers.judge import judge_stage
from hybridflow.trainer.build import build_groups, checkpoint_layouts, model_tensors, rollout_weights, weights_bytes
from hybridflow.trainer.checkpointing import load_latest, save_step
from hybridflow.trainer.dapo import dapo_stages, refill_seed, step_collector
from hybridflow.trainer.interrupt import GracefulInterrupt
from hybridflow.trainer.plot import plot_run
from hybridflow.trainer.tracking import Tracker
from hybridflow.workers.driver_rows import DriverBatch, hand_on
from hybridflow.workers.rl_workers import CriticWorker

Metrics = dict[str, float]

log = logging.getLogger(__name__)
# A validation that may generate more tokens than this is announced as long, with the keys that shorten it.
_LONG_VALIDATION_TOKENS = 100_000


class TrainingError(RuntimeError):
    """The run stopped; the message names the step, the cause and the last good checkpoint."""


_REWARD_ERROR = f"{RewardError.__name__}: "  # how a worker's RewardError starts its WorkerError's reason


def mean_of_ranks(metrics: dict[str, Any]) -> dict[str, float]:
    """DP_SPLIT gathers each rank's float metrics into a list: average them."""
    return {k: sum(v) / len(v) if isinstance(v, list) else float(v) for k, v in metrics.items()}


def shares(batch: dict[str, Any], plan: list[list[torch.Tensor]], reads) -> tuple[PerReplica, PerReplica]:
    """Each replica's rows of `batch` (each row once; with several epochs, the rows any of its shares use)
    and its steps renumbered into them: the two arguments of an update, cut to the fields it `reads`."""
    parts = [rows_for_plan(select_fields(batch, reads), steps) for steps in plan]
    return PerReplica(rows for rows, _ in parts), PerReplica(steps for _, steps in parts)


class PromptChunk(NamedTuple):
    """One DataFlow item before the rollout: the step's sampling seed, some of its prompts and, for ReMax,
    the score of each prompt's greedy response [B] (the baseline stage fills it in)."""

    seed: int
    prompts: dict[str, Any]
    baseline: Optional[torch.Tensor] = None


def _stamped(batch: dict[str, Any], version: int) -> dict[str, Any]:
    """`batch` with WEIGHT_VERSION: the weight version that generated each of its rows."""
    batch[F.WEIGHT_VERSION] = torch.full((len(batch[F.RESPONSES]),), version, dtype=torch.long)
    return batch


def _per_item(fn: Callable[[Any], Any]) -> Callable[[Any, list], list]:
    """A DataFlow forward_fn applying a per-batch stage to each chunk it receives."""
    return lambda model, items: [fn(item) for item in items]


def _as_scored(batch: dict[str, Any]) -> dict[str, Any]:
    """A rollout batch as the rollout's worker scored it (no judge placed apart)."""
    return batch


class RLTrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        t = cfg.trainer
        self.plan = plan = RunPlan.from_config(cfg)  # what the config implies, computed once
        self.run_dir = plan.run_dir
        # A model only transformers builds is read when every role loading it runs on transformers.
        self.model_cfg = load_model_config(cfg.model.path, "model.path", needs_decoder(cfg, plan))
        critic_cfg = (load_model_config(cfg.critic.model_path, "critic.model_path",
                                        needs_decoder(cfg, plan, critic_model=True))
                      if cfg.critic.model_path else None)
        check_runnable(cfg, plan, self.model_cfg, critic_cfg)  # the last config checks, before any worker starts
        self.model_tensors = model_tensors(cfg, plan, self.model_cfg, critic_cfg)  # recorded in each checkpoint
        self.lora_base = lora_base(cfg.actor.lora.rank, cfg.model.path)  # adapters' base, checked on resume
        self.tokenizer = load_tokenizer(cfg.model, self.model_cfg)
        self.train_set = PromptDataset(cfg.data, self.tokenizer, cfg.data.train_files)
        self.val_set = PromptDataset(cfg.data, self.tokenizer, cfg.data.val_files) if cfg.data.val_files else None
        self.val_count = 0 if self.val_set is None else \
            min(len(self.val_set), cfg.data.val_max_samples or len(self.val_set))
        check_prompt_count(cfg.data, len(self.train_set))  # checked once the data is read
        d = cfg.data
        self.sampler = PromptSampler(self.train_set, d.train_batch_size, d.shuffle, d.seed, d.skip_uniform_passes,
                                     refills=cfg.algorithm.dynamic_sampling.enabled)
        self.reward_fn = load_reward_function(cfg.reward, filter(None, (self.train_set, self.val_set)))
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.kl_coef,
                                           cfg.algorithm.kl_ctrl.target_kl, cfg.algorithm.kl_ctrl.horizon)
        self.needs_ref = plan.needs_reference
        self.needs_old = plan.needs_old_log_probs
        self.needs_baseline = plan.needs_greedy_baseline
        self.chunk_prompts = plan.chunk_prompts
        # A chunk smaller than the batch, or a refill, pads its prompts to the batch's width (the same shapes).
        self.pad_chunks = plan.chunk_prompts < cfg.data.train_batch_size or self.sampler.refills
        groups = build_groups(cfg, plan)
        self.actor, self.critic, self.reward_model = groups.actor, groups.critic, groups.reward_model
        self.separate_reference = groups.reference  # the reference on devices of its own (under FSDP), or None
        self.separate_rollout = groups.rollout  # rollout apart from training: fed the actor's weights
        self.judge = groups.judge  # reward.judge on a group of its own: it scores each rollout batch here
        self._judged = judge_stage(groups.judge, cfg.reward) if groups.judge is not None else _as_scored
        self.rollout_group = groups.generation
        self.version = 0  # the actor's weight version: the updates (steps) it has taken
        # The one owner of the rollout's weights (colocated, apart, or off-policy ahead of the update).
        self.weights = rollout_weights(cfg, plan, groups, self._prompt_chunks, self._generate_chunks,
                                       self._restored_chunks)
        # Launched by torchrun: every rank runs this loop over its LocalWorkerGroup share.
        self.spmd_driver = not plan.uses_ray and plan.job_world > 1
        self.is_main = not self.spmd_driver or int(os.environ.get("RANK", "0")) == 0
        self.token_stage = self._build_token_stage()
        self.flow = self._build_flow()
        self.batch_stages = self._build_batch_stages()
        self.collect = step_collector(cfg, self.sampler, lambda step, k: self._run_flow(self._prompt_chunks(step, k)),
                                      self.needs_baseline)  # DAPO's dynamic sampling, or the step's one batch
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", t.keep_last)

    def _build_flow(self) -> DataFlow:
        """Per-chunk preparation as a DataFlow: [baseline] -> rollout -> reward -> [reference and old log-probs]
        -> [values].

        Items are prompt chunks; with dataflow.async_execution the reward and
        log-prob stages start on the first chunk while later chunks generate.
        Sampling noise is keyed by (step, prompt, sample), so chunking, async
        execution and the number of ranks do not change the samples. ReMax
        (plan.needs_greedy_baseline) first generates one greedy response per
        prompt on the same rollout engine and scores it with the same reward.
        When the rollout generates ahead (`self.weights.ahead`, off-policy) the
        chunks come generated: the flow starts at the reward.
        """
        stages = [] if self.weights.ahead else [("rollout", self.actor, self._rollout_chunk)]
        stages.append(("reward", self.reward_fn, self._score))
        if self.needs_baseline:  # sync only (the config refuses remax off-policy)
            stages.insert(0, ("baseline", self.actor, self._baseline))
        if self.needs_ref or self.needs_old:  # one call, one shipment of the rows, for both passes
            stages.append(("log_probs", self.actor, self._log_probs))
        if self.critic is not None:
            stages.append(("values", self.critic, self._values))
        nodes = [Node(name, model=model, forward_fn=_per_item(fn)) for name, model, fn in stages]
        return DataFlow(nodes, list(zip(nodes, nodes[1:])))

    def _build_token_stage(self) -> TokenStage:
        a, actor = self.cfg.algorithm, self.cfg.actor
        return TokenStage(a.adv_estimator, a.gamma, a.lam, a.norm_adv_by_std_in_grpo,
                          kl_penalty=a.kl_penalty if a.use_kl_in_reward else None, old=self.needs_old,
                          reference=self.needs_ref, correction=actor.off_policy_correction,
                          correction_level=actor.off_policy_correction_level,
                          correction_threshold=actor.off_policy_correction_threshold)

    def _build_batch_stages(self) -> list[Callable[[dict, Metrics], dict]]:
        """What needs the whole batch: the token-level preparation (scores on the last token, [KL in reward],
        advantages, token figures) in the actor's rank 0, group filtering and the sampler's notes here.

        Each stage takes (batch, metrics), returns the batch and adds its figures to metrics.
        """
        stages = []
        if self.sampler.adaptive:
            stages.append(self._note_uniform_prompts)
        if self.needs_baseline:
            stages.append(self._baseline_metrics)
        stages += dapo_stages(self.cfg, self._prepare_tokens)  # [overlong shaping], tokens, [overlong filter]
        if self.cfg.algorithm.skip_uniform_groups:
            # ReMax compares each sample with its prompt's greedy response, not with the other samples.
            stages.append(self._drop_groups_at_baseline if self.needs_baseline else self._drop_uniform_groups)
        return stages

    # -- the iteration --------------------------------------------------------
    def prompts(self, step: int, refill: int = 0) -> dict[str, Any]:
        """The prompts of training step `step` (1-based) or of its k-th `refill`: a function of (seed, step) only,
        unless data.skip_uniform_passes or refills make them depend on the steps before (data/sampler.py)."""
        items = self.sampler.more(step) if refill else self.sampler.batch(step)
        return self.train_set.collate(items, pad_to=self.cfg.data.max_prompt_length
                                      if self.cfg.rollout.pad_to_max_length or self.sampler.refills else None)

    def _prompt_chunks(self, step: int, refill: int = 0) -> list[PromptChunk]:
        """Step `step`'s prompts (or its refill's) as the flow's items (sampling seed, prompt chunk)."""
        seed = refill_seed(self.cfg.trainer.seed, step, refill)
        return [PromptChunk(seed, chunk) for chunk in chunk_rows(self.prompts(step, refill), self.chunk_prompts)]

    def _generate_chunks(self, items: list[PromptChunk], version: int) -> list[dict[str, Any]]:
        """The rollout group's batches of a step's chunks, generated by weight `version` (the stream's
        thread calls this)."""
        return [_stamped(self._generate(item.prompts, item.seed, TRAIN, self.pad_chunks), version) for item in items]

    def _generate(self, prompts: dict[str, Any], seed: int, mode: str, pad: bool) -> dict[str, Any]:
        """The rollout group's batch; the rule reward failing where the rollout scored it (user code: the
        message names the function and its line, `roles.scoring.RewardError`) as that one line."""
        try:
            batch = self.rollout_group.generate(prompts, seed, mode, pad)
        except WorkerError as exc:
            if exc.reason.startswith(_REWARD_ERROR):
                raise TrainingError(exc.reason.removeprefix(_REWARD_ERROR)) from None
            raise
        try:
            return self._judged(batch)  # a judge placed apart scores the rows here
        except RewardError as exc:
            raise TrainingError(str(exc)) from None

    def rollout(self, prompts: dict[str, Any], seed: int, mode: str = TRAIN, pad: bool = False) -> dict[str, Any]:
        """The rollout batch of `prompts` from the trainer's weights; mode: TRAIN, VALIDATION or BASELINE
        (`roles.rollout.MODES`)."""
        return self.weights.rollout(self.version, lambda: self._generate(prompts, seed, mode, pad))

    def prepare(self, step: int) -> tuple[dict[str, Any], Metrics, Any]:
        """Prompts of `step` through the flow, chunk by chunk ([refilled: `trainer/dapo.py`]), then the
        whole-batch stages. Returns the batch, its metrics and the flow's result (timings)."""
        taken = self.weights.take(step, self.version)  # prompt chunks, or (off-policy) chunks generated ahead
        got = self.collect(step, self._run_flow(taken.output))  # with dynamic sampling, refilled
        metrics, batch = {**self._rollout_metrics(got.generated), **taken.metrics, **got.metrics}, got.batch
        for stage in self.batch_stages:
            batch = DriverBatch(stage(batch, metrics))
        return dict(batch), metrics, got.flow

    def _run_flow(self, items: list) -> tuple[DriverBatch, Any]:
        """The flow over one batch's items: the batch, as the driver's stages see it, and the flow's result."""
        try:
            result = self.flow.run(items, async_execution=self.cfg.dataflow.async_execution, min_batch=1)
        except NodeError as exc:  # a worker (or the reward function) failed inside a stage: report that error
            if isinstance(exc.__cause__, (WorkerError, TrainingError)):
                raise exc.__cause__ from None
            raise
        # The driver's stages read one number a row, never token rows: held to that here as under Ray.
        return DriverBatch(concat_batches(result.final) if len(result.final) > 1 else result.final[0]), result

    def update(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        """Critic, then actor: each replica trains on its share of mini-batches drawn once for the whole
        batch (`data.batch.mini_batch_plan`), so every layout takes the one-process optimizer steps."""
        rows = len(batch[F.INPUT_IDS])
        if rows == 0:
            return {"actor/skipped": 1.0}
        self.weights.release()  # switch back to training: the generation weights are freed
        stats, cfg, seed, layouts = {}, self.cfg, self.cfg.trainer.seed, self.plan.layouts
        if self.critic is not None:
            minis = critic_update_plan(cfg.critic, self.plan.mini_batch_responses, seed, step, rows,
                                       layouts["critic"].dp)
            reads = method_reads(CriticWorker.update_critic)
            stats.update(mean_of_ranks(self.critic.update_critic(*shares(batch, minis, reads))))
        minis = actor_update_plan(cfg.actor, cfg.rollout.n, seed, step, rows, layouts["training"].dp)
        reads = update_fields(cfg.actor, self.needs_old)  # named by whether the old log-prob pass ran
        stats.update(mean_of_ranks(self.actor.update_actor(*shares(batch, minis, reads))))
        return stats

    def _restored_chunks(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Generated chunks as the flow takes them: one restored from a checkpoint's rollout buffer saved before
        the rollout scored its rows is scored here (`_scored_here`)."""
        return [chunk if F.RULE_SCORES in chunk else self._scored_here(chunk) for chunk in chunks]

    def _scored_here(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A batch from a checkpoint's rollout buffer saved before the rollout scored its rows (it holds its
        tensors and texts): scored here, with the per-row figures the driver reads, as the rollout would (the
        reward section's scorer: its kind, time limit and processes)."""
        try:
            batch = self._judged(score_with_config(batch, self.cfg.reward, self.reward_fn))
        except RewardError as exc:
            raise TrainingError(str(exc)) from None
        return row_figures(batch)

    # -- preparation stages (per chunk) ------------------------------------------
    def _rollout_chunk(self, item: PromptChunk) -> dict[str, Any]:
        """The chunk's samples; with a ReMax baseline, BASELINE_SCORES repeated over each prompt's n rows."""
        batch = self.rollout(item.prompts, item.seed, pad=self.pad_chunks)
        if item.baseline is not None:
            batch[F.BASELINE_SCORES] = item.baseline.repeat_interleave(self.cfg.rollout.n)
        return _stamped(batch, self.version)

    def _baseline(self, item: PromptChunk) -> PromptChunk:
        """ReMax: one greedy response per prompt, on the rollout engine that samples, scored as the samples are
        (`_outcome`). Greedy decoding draws no noise; the step's seed is passed as for the samples."""
        greedy = self.rollout(item.prompts, item.seed, BASELINE, pad=self.pad_chunks)
        return item._replace(baseline=self._outcome(greedy) + S.env_scores(greedy))

    def _outcome(self, batch) -> torch.Tensor:
        """rule_weight * rule score (scored by the rollout, RULE_SCORES) (+ model_weight * reward-model score)
        per row [B]."""
        r = self.cfg.reward
        outcome = r.rule_weight * batch[F.RULE_SCORES]
        if self.reward_model is not None:
            pairs = hand_on(batch, (F.PROMPT_TEXT, F.RESPONSE_TEXT))
            outcome = outcome + r.model_weight * self._reward_model_scores(pairs)
        return outcome

    def _score(self, batch):
        """SCORES: rule_weight * rule score (+ model_weight * reward-model score) (+ the environment's rewards
        of a multi-turn rollout); OUTCOME_SCORES: the first two, which `_prepare_tokens` places on the last
        response token (each environment reward on the turn it answers)."""
        batch = DriverBatch(batch)
        batch[F.OUTCOME_SCORES] = self._outcome(batch)
        batch[F.SCORES] = batch[F.OUTCOME_SCORES] + S.env_scores(batch)
        return dict(batch)

    def _reward_model_scores(self, pairs: dict[str, list]) -> torch.Tensor:
        return self.reward_model.score(pairs)[F.SCORES]  # DP_SPLIT pads for equal shares and strips the answer

    def _log_probs(self, batch):
        apart = self.separate_reference is not None
        if apart:
            batch.update(self.separate_reference.compute_ref_log_probs(batch))
        batch.update(self.actor.compute_log_probs(batch, old=self.needs_old, reference=self.needs_ref and not apart))
        return batch

    def _values(self, batch):
        batch.update(self.critic.compute_values(batch))
        return batch

    # -- preparation stages (whole batch) ---------------------------------------
    def _rollout_metrics(self, batch) -> Metrics:
        """Rewards, lengths and staleness, from what the driver holds of each row (the token figures come
        from `_prepare_tokens`)."""
        metrics = S.rollout_metrics(batch)
        metrics.update(staleness_metrics(self.version - batch[F.WEIGHT_VERSION]))
        if F.RULE_REWARD_SECONDS in batch:  # the rollout's seconds in the rule reward, summed over its replicas
            metrics["timing/rule_reward_s"] = batch.pop(F.RULE_REWARD_SECONDS).sum().item()
        metrics.update(reward_counts(batch))  # rows that scored 0 because their reward failed
        return metrics

    def _prepare_tokens(self, batch, metrics: Metrics):
        """TOKEN_SCORES, TOKEN_REWARDS, ADVANTAGES and RETURNS, made in the actor's rank 0 from the rows in the
        object store (`roles.preparation`); with a KL penalty in the reward, the controller adapts its
        coefficient to the KL that came back."""
        coef = self.kl_ctrl.value
        fields, figures = self.actor.prepare_tokens(hand_on(batch, PREPARATION_READS), self.token_stage, coef)
        batch.update(fields)
        metrics.update(figures)
        if self.token_stage.kl_penalty is not None:
            metrics["actor/kl_coef"] = coef
            self.kl_ctrl.update(figures["actor/kl_in_reward"], n_steps=len(batch[F.SCORES]))
        return batch

    def _note_uniform_prompts(self, batch, metrics: Metrics):
        """The sampler skips the next passes over prompts whose group had no signal (and scored at least
        data.skip_uniform_min_score)."""
        self.sampler.observe(batch[F.INDEX], S.uniform_rows(batch, self.cfg.data.skip_uniform_min_score))
        metrics.update(self.sampler.metrics())
        return batch

    def _drop_uniform_groups(self, batch, metrics: Metrics):
        keep = S.nonuniform_rows(batch)
        metrics["batch/kept_fraction"] = keep.float().mean().item()
        return take_rows(batch, keep)

    def _drop_groups_at_baseline(self, batch, metrics: Metrics):
        """ReMax's uniform groups: every sample of the prompt scored what its greedy response did (advantage 0)."""
        keep = S.rows_off_baseline(batch)
        metrics["batch/kept_fraction"] = keep.float().mean().item()
        return take_rows(batch, keep)

    def _baseline_metrics(self, batch, metrics: Metrics):
        metrics.update(S.baseline_metrics(batch, self.cfg.rollout.n))
        return batch

    # -- validation -----------------------------------------------------------
    def _announce_validation(self) -> None:
        """Say up front what a validation costs; a long one says how to shorten it."""
        d = self.cfg.data
        batches = -(-self.val_count // d.val_batch_size)
        where = f"the first {self.val_count} of {len(self.val_set)}" if self.val_count < len(self.val_set) \
            else f"all {self.val_count}"
        line = (f"validation: {where} prompts, up to {d.max_response_length} new tokens each, "
                f"{batches} batch{'es' if batches > 1 else ''} of <= {d.val_batch_size}")
        if self.val_count * d.max_response_length > _LONG_VALIDATION_TOKENS:
            log.warning(f"{line}: this can take long (progress and ETA follow each batch); "
                        "data.val_max_samples caps the prompts, trainer.val_before_train=false skips the "
                        "one before step 1, trainer.val_every sets how often it runs")
        else:
            log.info(line)

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        if self.val_set is None or self.val_count == 0:
            return {}
        if self.is_main:
            self._announce_validation()
        rows, started, done = [], time.perf_counter(), 0
        size = self.cfg.data.val_batch_size
        for start in range(0, self.val_count, size):
            items = [self.val_set[i] for i in range(start, min(start + size, self.val_count))]
            real = len(items)  # any count: DP_SPLIT pads for equal shares and strips the answer
            batch = self.rollout(self.val_set.collate(items), self.cfg.trainer.seed, VALIDATION)
            batch[F.SCORES] = self.cfg.reward.rule_weight * batch[F.RULE_SCORES] + S.env_scores(batch)
            rows.append(select_fields(batch, (F.SCORES, F.RESPONSE_LENGTH, F.ENV_STATS)))  # its rows in the store go
            done += real
            if self.is_main:
                elapsed = time.perf_counter() - started
                eta = elapsed / done * (self.val_count - done)
                log.info(f"validation: {done}/{self.val_count} prompts, {elapsed:.0f} s elapsed, "
                         f"ETA {eta:.0f} s")
        scores = torch.cat([b[F.SCORES] for b in rows]).float()
        lengths = torch.cat([b[F.RESPONSE_LENGTH] for b in rows]).float()
        env = [s for b in rows for s in b.get(F.ENV_STATS, [])]
        return {"val/accuracy": (scores >= 1.0).float().mean().item(), "val/reward_mean": scores.mean().item(),
                "val/response_length": lengths.mean().item(), "val/n": float(len(scores)),
                **(S.env_metrics(env, "val/") if env else {})}

    # -- checkpoints ----------------------------------------------------------
    def _groups(self) -> list:
        return [g for g in (self.actor, self.critic) if g is not None]  # the ones with checkpoints

    def _every_group(self) -> list:
        """Every worker group of the run: those with checkpoints, a reward model's, a rollout group and a
        reference apart."""
        return [g for g in (*self._groups(), self.reward_model, self.separate_rollout, self.separate_reference,
                            self.judge) if g is not None]

    def save_checkpoint(self, step: int) -> Path:
        """Save step `step`: every rank's shard and trainer.json (`trainer/checkpointing.py`)."""
        state = trainer_state(step, self.model_tensors, checkpoint_layouts(self.plan, self.cfg), self.kl_ctrl.value,
                              self.sampler.state_dict() if self.sampler.adaptive else None, self.lora_base)
        floor = weights_bytes(self.cfg, self.model_tensors)  # the free space a save needs at least
        self.weights.saving(self.version)
        return save_step(self.ckpt, step, self._saved(), state, floor, self.spmd_driver)

    def _saved(self) -> list:
        """What a checkpoint holds: every group's shards, and what the weights' owner keeps (batches generated
        ahead)."""
        return self._groups() + self.weights.checkpointed()

    def restore(self) -> int:
        """Load the newest checkpoint when trainer.resume=auto; returns the step to continue after."""
        if self.cfg.trainer.resume != "auto":
            return 0
        paths = {"actor": self.cfg.model.path, "critic": self.cfg.critic.model_path or self.cfg.model.path}
        found = load_latest(self.ckpt, self.spmd_driver, self._saved(), self.sampler, self.model_tensors,
                            checkpoint_layouts(self.plan, self.cfg), paths, self.lora_base)
        if found is None:
            return 0
        step, directory, state = found
        self.version = step
        self.weights.resume(step)  # the restored weights on their way to the rollout
        if "kl_coef" in state:  # absent where `hybridflow reshard` made the step from an HF model (step 0)
            self.kl_ctrl.value = state["kl_coef"]
        log.info("resumed from %s (step %d)", directory, step)
        return step

    def export_hf(self) -> Path:
        return Path(self.actor.export_hf(str(self.run_dir / "hf_actor")))

    def shutdown(self) -> None:
        self.weights.close()
        for group in self._every_group():
            group.shutdown()

    # -- the loop -------------------------------------------------------------
    def shipped_bytes(self) -> int:
        """Tensor bytes the controller's calls have delivered to the ranks of every group so far."""
        return sum(g.group.shipped_bytes for g in self._every_group())

    def received_bytes(self) -> int:
        """Tensor bytes the groups' answers have brought back to the controller so far."""
        return sum(g.group.received_bytes for g in self._every_group())

    def train_step(self, step: int) -> dict[str, float]:
        try:
            return self._train_step(step)
        except WorkerError:
            # Off-policy, a rollout rank that died fails the stream's weight push too, and its peers on the
            # actor's side tear their group down: the call this thread made then fails second-hand. The
            # stream's own failure names the rank that died.
            cause = self.weights.failure()
            if getattr(cause, "reason", None) == DIED:
                raise cause from None
            raise

    def _train_step(self, step: int) -> dict[str, float]:
        start, shipped, received = time.perf_counter(), self.shipped_bytes(), self.received_bytes()
        busy = self.weights.busy_s
        batch, metrics, flow = self.prepare(step)
        prepared = time.perf_counter()
        metrics.update(self.update(batch, step))
        self.version = step
        metrics.update(self.weights.updated(step))  # e.g. the reshard/* figures of the switch to generation
        metrics.update({f"timing/{name}_s": seconds for name, seconds in flow.timings.items()})
        metrics["timing/prepare_wall_s"] = prepared - start
        metrics["timing/overlap_s"] = flow.overlap_s
        metrics["timing/update_s"] = time.perf_counter() - prepared
        metrics["timing/step_s"] = time.perf_counter() - start
        # The rollout's seconds generating in this step's span (generating ahead: busy while training too).
        metrics["timing/rollout_busy_s"] = self.weights.busy_s - busy
        metrics["perf/tokens_per_s"] = metrics["batch/tokens"] / metrics["timing/step_s"]
        metrics["controller/shipped_bytes"] = float(self.shipped_bytes() - shipped)
        metrics["controller/received_bytes"] = float(self.received_bytes() - received)
        # every tensor byte that passed through the driver this step, out to the groups and back
        metrics["controller/driver_bytes"] = metrics["controller/shipped_bytes"] + metrics["controller/received_bytes"]
        metrics.update(self.weights.metrics())  # the sync/* figures of the weight moves this step used
        return metrics

    def _loop(self, start: int, stop_after: Optional[int], tracker: Tracker, summary: dict[str, Any],
              interrupt: GracefulInterrupt) -> None:
        """The steps of `fit`. A first Ctrl-C ends the loop after the step in progress, which is saved."""
        t = self.cfg.trainer
        if start == 0 and t.val_before_train:
            first = self.validate()
            tracker.log(0, first)
            summary["start"] = first
        last = start
        for step in range(start + 1, t.total_steps + 1):
            if stop_after is not None and step > start + stop_after:
                break
            try:
                metrics = self.train_step(step)
            except WorkerError as exc:
                good = self.ckpt.latest()
                where = f"the last good checkpoint is {good[1]}" if good else "no checkpoint was saved"
                reason = exc.reason.removeprefix("NonFiniteError: ")
                raise TrainingError(f"step {step}: {reason}; stopped, {where}\n{exc}") from exc
            stopping = self._all_agree_to_stop(interrupt.requested)
            if not stopping and ((t.val_every and step % t.val_every == 0) or step == t.total_steps):
                metrics.update(self.validate())
            tracker.log(step, metrics)
            if stopping or (t.save_every and step % t.save_every == 0) or step == t.total_steps:
                with interrupt.critical():
                    summary["checkpoint"] = self.save_checkpoint(step)
            last = step
            summary["end"] = metrics
            if stopping:
                summary["interrupted"] = True
                break
        summary["steps"] = last
        if last == t.total_steps:
            with interrupt.critical():
                summary["hf_actor"] = self.export_hf()

    def _all_agree_to_stop(self, requested: bool) -> bool:
        """Under torchrun every rank runs this loop and must stop at the same step (a rank running
        on alone would wait in a collective until the timeout): the ranks' flags are OR-ed."""
        if not self.spmd_driver:
            return requested
        import torch.distributed as dist

        flag = torch.tensor([int(requested)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def fit(self, stop_after: Optional[int] = None) -> dict[str, Any]:
        """Train to trainer.total_steps (or stop after `stop_after` steps, for tests); returns a summary."""
        t = self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        start = self.restore()
        if start == 0 and t.overwrite and self.is_main:
            self.ckpt.clear()  # else a crash before the first save would leave the old run to resume
        # A fresh run (start 0) in an existing run directory starts a new metrics file.
        tracker = Tracker(self.run_dir, t.loggers if self.is_main else [], t.total_steps,
                          resume_from_step=start if start > 0 else -1, config=to_dict(self.cfg),
                          project=t.project, name=t.experiment)
        summary: dict[str, Any] = {"run_dir": self.run_dir}
        with tracker:  # a raised error closes it as failed (W&B and MLflow mark the run)
            with GracefulInterrupt() as interrupt:
                self._loop(start, stop_after, tracker, summary, interrupt)
            if t.plot and "jsonl" in t.loggers and self.is_main:
                summary["plots"] = plot_run(self.run_dir)
            for path in summary.get("plots", []):
                tracker.add_artifact(path, "plots")
            if "hf_actor" in summary and self.is_main:
                tracker.add_artifact(summary["hf_actor"], "hf_actor")
        return summary
