"""The PPO/GRPO trainer: one process, one Config, the loop as the algorithm reads.

    for step in steps:
        batch = rollout(prompts)      # actor in the generation layout (views of its weights)
        batch = prepare(batch)        # scores, reference/old log-probs, KL, values, advantages
        stats = update(batch)         # actor (and critic) PPO epochs

Which preparation and update stages run is decided once, when the trainer is
built from the config. Checkpoints hold each engine's shard (weights, Adam
state, LR schedule) and the step; data order and sampling seeds are functions
of (seed, step), so a resumed run repeats an uninterrupted one exactly.
"""
from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hybridflow.algos import build_kl_controller
from hybridflow.config.loader import ConfigError
from hybridflow.config.schema import Config
from hybridflow.data import fields as F
from hybridflow.data.dataset import PromptDataset, batches_per_epoch, iterate_batches
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.engine import MegatronEngine
from hybridflow.hybrid_engine import generation_model
from hybridflow.models.checkpoint import load_hf_state_dict, save_hf_checkpoint
from hybridflow.models.config import DecoderConfig
from hybridflow.rewards.registry import get_reward_fn
from hybridflow.rollout import Generator, SamplingParams
from hybridflow.trainer import rl_steps as S
from hybridflow.trainer.checkpointing import CheckpointManager, atomic_write_json
from hybridflow.trainer.plot import plot_run
from hybridflow.trainer.tracking import Tracker
from hybridflow.workers import Actor, Critic, Reference
from hybridflow.workers.actor import NonFiniteError

log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


class TrainingError(RuntimeError):
    """The run stopped; the message names the step, the cause and the last good checkpoint."""


def load_model_config(path: str, key: str) -> DecoderConfig:
    if not path:
        raise ConfigError(key, "no model path given")
    if not Path(path).exists():
        raise ConfigError(key, f"model path does not exist: {path}")
    try:
        return DecoderConfig.from_pretrained(path)
    except FileNotFoundError as exc:
        raise ConfigError(key, str(exc)) from exc


class RLTrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        t = cfg.trainer
        self.run_dir = Path(t.output_dir) / t.experiment
        torch.manual_seed(t.seed)
        self.model_cfg = load_model_config(cfg.model.path, "model.path")
        self.tokenizer = self._load_tokenizer()
        self.train_set = PromptDataset(cfg.data, self.tokenizer, cfg.data.train_files)
        self.val_set = PromptDataset(cfg.data, self.tokenizer, cfg.data.val_files) if cfg.data.val_files else None
        self.steps_per_epoch = batches_per_epoch(len(self.train_set), cfg.data.train_batch_size)
        if self.steps_per_epoch == 0:
            raise ConfigError("data.train_batch_size", f"{cfg.data.train_batch_size} is larger than the "
                              f"{len(self.train_set)} usable training prompts")
        self.reward_fn = get_reward_fn(cfg.reward.function)
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.kl_coef,
                                           cfg.algorithm.kl_ctrl.target_kl, cfg.algorithm.kl_ctrl.horizon)
        self._build_roles()
        self.prepare_stages = self._build_prepare_stages()
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", t.keep_last)

    # -- construction ---------------------------------------------------------
    def _load_tokenizer(self) -> Tokenizer:
        path = self.cfg.model.tokenizer_path or self.cfg.model.path
        if not Path(path).exists():
            raise ConfigError("model.tokenizer_path", f"tokenizer path does not exist: {path}")
        tok = Tokenizer.from_path(path)
        if tok.vocab_size > self.model_cfg.vocab_size:
            raise ConfigError("model.tokenizer_path", f"tokenizer at {path} has {tok.vocab_size} tokens but "
                              f"the model at {self.cfg.model.path} has vocab_size {self.model_cfg.vocab_size}")
        return tok

    def _engine(self, path: str, optim, parallel, value_head: bool = False) -> MegatronEngine:
        cfg = self.cfg
        a = cfg.actor
        rows = cfg.data.train_batch_size * cfg.rollout.n
        optimizer_steps = cfg.trainer.total_steps * a.ppo_epochs * -(-rows // max(1, a.ppo_mini_batch_size * cfg.rollout.n))
        engine = MegatronEngine(
            load_model_config(path, "critic.model_path" if value_head else "model.path"), parallel, optim,
            device=cfg.trainer.device, dtype=cfg.model.dtype,
            make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, value_head=value_head,
            total_steps=optimizer_steps, seed=cfg.trainer.seed)
        engine.load_hf_state_dict(load_hf_state_dict(path))
        return engine

    def _build_roles(self) -> None:
        cfg, alg = self.cfg, self.cfg.algorithm
        self.actor_engine = self._engine(cfg.model.path, cfg.actor.optim, cfg.actor.parallel)
        self.actor = Actor(cfg.actor, self.actor_engine, samples_per_prompt=cfg.rollout.n,
                           temperature=cfg.rollout.temperature, seed=cfg.trainer.seed)
        self.needs_ref = alg.use_kl_in_reward or cfg.actor.use_kl_loss
        self.reference = None
        if self.needs_ref:
            if not cfg.reference.enabled:
                raise ConfigError("reference.enabled", "KL (algorithm.use_kl_in_reward or "
                                  "actor.use_kl_loss) needs the reference policy")
            self.reference = Reference(cfg.reference, self._engine(cfg.model.path, None, cfg.reference.parallel),
                                       temperature=cfg.rollout.temperature)
        self.critic = None
        if alg.adv_estimator == "gae":
            path = cfg.critic.model_path or cfg.model.path
            self.critic = Critic(cfg.critic, self._engine(path, cfg.critic.optim, cfg.critic.parallel, True),
                                 mini_batch_size=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                                 seed=cfg.trainer.seed)
        if alg.adv_estimator == "remax":
            raise ConfigError("algorithm.adv_estimator", "remax needs a greedy baseline rollout, which this "
                              "trainer does not run yet; use grpo, rloo, reinforce_plus_plus(_baseline) or gae")
        self.generator = Generator(generation_model(self.actor_engine), self.tokenizer.pad_token_id, self.tokenizer)
        r = cfg.rollout
        stop_ids = tuple(i for i in (self.tokenizer.eos_token_id,) if i is not None)
        common = dict(max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids, stop=tuple(r.stop))
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       do_sample=r.do_sample, n=r.n, **common)
        self.val_sampling = SamplingParams(temperature=r.val_temperature, do_sample=r.val_temperature > 0,
                                           n=1, **common)

    def _build_prepare_stages(self) -> list[Callable[[dict], dict]]:
        stages = [self._score]
        if self.needs_ref:
            stages.append(self._ref_log_probs)
        stages.append(self._old_log_probs)
        if self.cfg.algorithm.use_kl_in_reward:
            stages.append(self._kl_in_reward)
        if self.critic is not None:
            stages.append(self._values)
        stages.append(self._advantages)
        if self.cfg.algorithm.skip_uniform_groups:
            stages.append(self._drop_uniform_groups)
        return stages

    # -- the iteration --------------------------------------------------------
    def prompts(self, step: int) -> dict[str, Any]:
        """The prompts of training step `step` (1-based): a function of (seed, step) only."""
        d = self.cfg.data
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        items = next(iterate_batches(self.train_set, d.train_batch_size, d.shuffle, d.seed, epoch,
                                     start_step=index))
        return self.train_set.collate(items, pad_to=d.max_prompt_length if self.cfg.rollout.pad_to_max_length else None)

    def rollout(self, prompts: dict[str, Any], params: SamplingParams, seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        out = self.generator.generate(prompts[F.INPUT_IDS], prompts[F.ATTENTION_MASK], params, generator=gen)
        return S.assemble_rollout(prompts, out, params.n, self.tokenizer)

    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        for stage in self.prepare_stages:
            batch = stage(batch)
        return batch

    def update(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        if len(batch[F.INPUT_IDS]) == 0:
            return {"actor/skipped": 1.0}
        stats = {}
        if self.critic is not None:
            stats.update(self.critic.update(batch, step))
        stats.update(self.actor.update(batch, step))
        return stats

    # -- preparation stages ---------------------------------------------------
    def _score(self, batch):
        batch[F.SCORES] = S.score(batch, self.reward_fn)
        batch[F.TOKEN_SCORES] = S.token_scores(batch[F.SCORES], batch[F.RESPONSE_MASK])
        batch[F.TOKEN_REWARDS] = batch[F.TOKEN_SCORES]
        batch["metrics"] = S.rollout_metrics(batch)
        return batch

    def _ref_log_probs(self, batch):
        batch.update(self.reference.compute_ref_log_probs(batch))
        return batch

    def _old_log_probs(self, batch):
        batch.update(self.actor.compute_log_probs(batch, self.cfg.rollout.log_prob_micro_batch_size))
        mask = batch[F.RESPONSE_MASK].bool()
        batch["metrics"]["actor/entropy"] = batch[F.ENTROPY][mask].mean().item()
        if self.needs_ref:
            diff = (batch[F.OLD_LOG_PROBS] - batch[F.REF_LOG_PROBS])[mask]
            batch["metrics"]["actor/kl"] = diff.mean().item()
        return batch

    def _kl_in_reward(self, batch):
        a = self.cfg.algorithm
        batch[F.TOKEN_REWARDS], kl = S.kl_in_reward(batch, self.kl_ctrl.value, a.kl_penalty)
        batch["metrics"].update({"actor/kl_in_reward": kl, "actor/kl_coef": self.kl_ctrl.value})
        self.kl_ctrl.update(kl, n_steps=len(batch[F.SCORES]))
        return batch

    def _values(self, batch):
        batch.update(self.critic.compute_values(batch))
        return batch

    def _advantages(self, batch):
        a = self.cfg.algorithm
        batch[F.ADVANTAGES], batch[F.RETURNS] = S.advantages(batch, a.adv_estimator, a.gamma, a.lam,
                                                             a.norm_adv_by_std_in_grpo)
        return batch

    def _drop_uniform_groups(self, batch):
        keep = S.nonuniform_rows(batch)
        batch["metrics"]["batch/kept_fraction"] = keep.float().mean().item()
        metrics = batch.pop("metrics")
        batch = S.select_rows(batch, keep)
        batch["metrics"] = metrics
        return batch

    # -- validation -----------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        if self.val_set is None:
            return {}
        rows = []
        size = self.cfg.data.val_batch_size
        for start in range(0, len(self.val_set), size):
            items = [self.val_set[i] for i in range(start, min(start + size, len(self.val_set)))]
            batch = self.rollout(self.val_set.collate(items), self.val_sampling, seed=self.cfg.trainer.seed)
            batch[F.SCORES] = S.score(batch, self.reward_fn)
            rows.append(batch)
        scores = torch.cat([b[F.SCORES] for b in rows]).float()
        lengths = torch.cat([b[F.RESPONSE_MASK].sum(-1) for b in rows]).float()
        return {"val/accuracy": (scores >= 1.0).float().mean().item(), "val/reward_mean": scores.mean().item(),
                "val/response_length": lengths.mean().item(), "val/n": float(len(scores))}

    # -- checkpoints ----------------------------------------------------------
    def _write_checkpoint(self, step: int, directory: Path) -> None:
        for name, engine in self._trained_engines().items():
            (directory / name).mkdir()
            torch.save(engine.state_dict(), engine.shard_path(directory / name))
        atomic_write_json(directory / "trainer.json", {"step": step, "kl_coef": self.kl_ctrl.value})

    def _trained_engines(self) -> dict[str, MegatronEngine]:
        engines = {"actor": self.actor_engine}
        if self.critic is not None:
            engines["critic"] = self.critic.engine
        return engines

    def save_checkpoint(self, step: int) -> Path:
        return self.ckpt.save(step, lambda d: self._write_checkpoint(step, d))

    def restore(self) -> int:
        """Load the newest checkpoint when trainer.resume=auto; returns the step to continue after."""
        if self.cfg.trainer.resume != "auto":
            return 0
        found = self.ckpt.latest()
        if found is None:
            return 0
        step, directory = found
        for name, engine in self._trained_engines().items():
            engine.load_state_dict(torch.load(engine.shard_path(directory / name), weights_only=False))
        state = json.loads((directory / "trainer.json").read_text())
        self.kl_ctrl.value = state["kl_coef"]
        log.info("resumed from %s (step %d)", directory, step)
        return step

    def export_hf(self) -> Path:
        tok_dir = Path(self.cfg.model.tokenizer_path or self.cfg.model.path)
        extra = tuple(tok_dir / f for f in _TOKENIZER_FILES if (tok_dir / f).is_file())
        hf_config = self.model_cfg.to_hf_dict()
        hf_config["torch_dtype"] = self.cfg.model.dtype
        return save_hf_checkpoint(self.actor_engine.hf_state_dict(), hf_config, self.run_dir / "hf_actor",
                                  extra_files=extra)

    # -- the loop -------------------------------------------------------------
    @contextmanager
    def _timed(self, metrics: dict[str, float], name: str):
        start = time.perf_counter()
        yield
        metrics[f"timing/{name}_s"] = time.perf_counter() - start

    def train_step(self, step: int) -> dict[str, float]:
        timing: dict[str, float] = {}
        start = time.perf_counter()
        with self._timed(timing, "rollout"):
            batch = self.rollout(self.prompts(step), self.sampling, seed=self.cfg.trainer.seed * 1_000_003 + step)
        tokens = S.real_tokens(batch)
        with self._timed(timing, "prepare"):
            batch = self.prepare(batch)
        with self._timed(timing, "update"):
            stats = self.update(batch, step)
        metrics = {**batch.pop("metrics"), **stats, **timing}
        metrics["timing/step_s"] = time.perf_counter() - start
        metrics["perf/tokens_per_s"] = tokens / metrics["timing/step_s"]
        return metrics

    def fit(self, stop_after: Optional[int] = None) -> dict[str, Any]:
        """Train to trainer.total_steps (or stop after `stop_after` steps, for tests); returns a summary."""
        t = self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        start = self.restore()
        tracker = Tracker(self.run_dir, t.loggers, t.total_steps, resume_from_step=start)
        summary: dict[str, Any] = {"run_dir": self.run_dir}
        try:
            if start == 0:
                first = self.validate()
                tracker.log(0, first)
                summary["start"] = first
            last = start
            for step in range(start + 1, t.total_steps + 1):
                if stop_after is not None and step > start + stop_after:
                    break
                try:
                    metrics = self.train_step(step)
                except NonFiniteError as exc:
                    good = self.ckpt.latest()
                    where = f"the last good checkpoint is {good[1]}" if good else "no checkpoint was saved"
                    raise TrainingError(f"step {step}: {exc.metric} is {exc.value}; stopped, {where}") from exc
                if (t.val_every and step % t.val_every == 0) or step == t.total_steps:
                    metrics.update(self.validate())
                tracker.log(step, metrics)
                if (t.save_every and step % t.save_every == 0) or step == t.total_steps:
                    summary["checkpoint"] = self.save_checkpoint(step)
                last = step
                summary["end"] = metrics
            summary["steps"] = last
            if last == t.total_steps:
                summary["hf_actor"] = self.export_hf()
        finally:
            tracker.close()
        if "jsonl" in t.loggers:
            summary["plots"] = plot_run(self.run_dir)
        return summary
