"""The SPMD workers of a PPO/GRPO job, one class per process role.

- `ActorRolloutRefWorker`: the hybrid layout. The actor's engine, the
  generator over views of its weights and (optionally) the frozen reference
  live in one process, so rollout needs no weight transfer.
- `CriticWorker`: the value model, colocated with the actor or on its own devices.

Each runs inside a worker group (`hybridflow.controller`): a Ray actor per
device, or in-process (`LocalWorkerGroup`). Methods take this rank's share of
a batch (`DP_SPLIT`) and return per-row fields or per-rank metrics; the
controller never writes communication code.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.loader import ConfigError
from hybridflow.config.schema import Config
from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.worker_group import Worker
from hybridflow.data import fields as F
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.engine import MegatronEngine
from hybridflow.hybrid_engine import generation_model
from hybridflow.models.checkpoint import load_hf_state_dict, save_hf_checkpoint
from hybridflow.models.config import DecoderConfig
from hybridflow.rollout import GenerationOutput, Generator, SamplingParams
from hybridflow.workers.actor import Actor
from hybridflow.workers.critic import Critic
from hybridflow.workers.reference import Reference

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def load_model_config(path: str, key: str) -> DecoderConfig:
    """The HF config at `path`; a missing path is a ConfigError naming `key`."""
    if not path:
        raise ConfigError(key, "no model path given")
    if not Path(path).exists():
        raise ConfigError(key, f"model path does not exist: {path}")
    try:
        return DecoderConfig.from_pretrained(path)
    except FileNotFoundError as exc:
        raise ConfigError(key, str(exc)) from exc


def load_tokenizer(cfg: Config, model_cfg: DecoderConfig) -> Tokenizer:
    path = cfg.model.tokenizer_path or cfg.model.path
    if not Path(path).exists():
        raise ConfigError("model.tokenizer_path", f"tokenizer path does not exist: {path}")
    tok = Tokenizer.from_path(path)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ConfigError("model.tokenizer_path", f"tokenizer at {path} has {tok.vocab_size} tokens but "
                          f"the model at {cfg.model.path} has vocab_size {model_cfg.vocab_size}")
    return tok


def sampling_params(cfg: Config, tokenizer: Tokenizer, validation: bool = False) -> SamplingParams:
    r = cfg.rollout
    stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
    common = dict(max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids, stop=tuple(r.stop))
    if validation:
        return SamplingParams(temperature=r.val_temperature, do_sample=r.val_temperature > 0, n=1, **common)
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, do_sample=r.do_sample,
                          n=r.n, **common)


def needs_reference(cfg: Config) -> bool:
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


def build_engine(cfg: Config, path: str, optim, parallel, value_head: bool = False) -> MegatronEngine:
    """An engine loaded from the HF checkpoint at `path`; its LR schedule spans the run."""
    a = cfg.actor
    rows = cfg.data.train_batch_size * cfg.rollout.n
    steps = cfg.trainer.total_steps * a.ppo_epochs * -(-rows // max(1, a.ppo_mini_batch_size * cfg.rollout.n))
    engine = MegatronEngine(
        load_model_config(path, "critic.model_path" if value_head else "model.path"), parallel, optim,
        device=cfg.trainer.device, dtype=cfg.model.dtype,
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, value_head=value_head,
        total_steps=steps, seed=cfg.trainer.seed)
    engine.load_hf_state_dict(load_hf_state_dict(path))
    return engine


def prepare_process(worker: Worker) -> None:
    """Per-process set-up of a worker: CPU threads, and quiet megatron-core.

    Torch threads become this rank's share of the node's cores (Ray starts
    actors with one). megatron-core narrates its set-up at INFO and warns about
    deprecated calls it makes itself; a worker keeps its warnings and errors.
    """
    import logging
    import warnings

    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"(megatron|torch\.distributed)(\..*)?")
    if worker.context.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, worker.world_size)))


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad [B, R] to [B, width] so every rank returns the same shape."""
    if t.shape[1] >= width:
        return t
    return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), value)], dim=1)


class ActorRolloutRefWorker(Worker):
    """Actor training, rollout from views of its weights, and the reference policy: one process."""

    def __init__(self, cfg: Config):
        self.init_process_group()
        prepare_process(self)
        torch.manual_seed(cfg.trainer.seed)
        self.cfg = cfg
        self.model_cfg = load_model_config(cfg.model.path, "model.path")
        self.tokenizer = load_tokenizer(cfg, self.model_cfg)
        self.engine = build_engine(cfg, cfg.model.path, cfg.actor.optim, cfg.actor.parallel)
        self.actor = Actor(cfg.actor, self.engine, samples_per_prompt=cfg.rollout.n,
                           temperature=cfg.rollout.temperature, seed=cfg.trainer.seed)
        self.reference = None
        if needs_reference(cfg):
            if not cfg.reference.enabled:
                raise ConfigError("reference.enabled", "KL (algorithm.use_kl_in_reward or "
                                  "actor.use_kl_loss) needs the reference policy")
            self.reference = Reference(cfg.reference, build_engine(cfg, cfg.model.path, None, cfg.reference.parallel),
                                       temperature=cfg.rollout.temperature)
        self.generator = Generator(generation_model(self.engine), self.tokenizer.pad_token_id, self.tokenizer)
        self.sampling = {False: sampling_params(cfg, self.tokenizer), True: sampling_params(cfg, self.tokenizer, True)}

    @register(Dispatch.DP_SPLIT)
    def generate(self, prompts: dict[str, Any], seed: int, validation: bool = False,
                 pad: bool = False) -> dict[str, Any]:
        """This rank's prompts -> the rollout batch (fields in `data.fields`), responses padded to max length."""
        from hybridflow.trainer.rl_steps import assemble_rollout

        params = self.sampling[validation]
        ids, mask = prompts[F.INPUT_IDS], prompts[F.ATTENTION_MASK]
        # Noise keyed by (seed, dataset row, sample): a prompt's samples do not
        # depend on the rank, chunk or batch it is generated in.
        keys = seed * 1_000_003 + torch.as_tensor(prompts[F.INDEX], dtype=torch.long)
        # rollout.batch_size_per_device: generate this rank's prompts that many at a time.
        size = self.cfg.rollout.batch_size_per_device or len(ids)
        parts = [self.generator.generate(ids[i:i + size], mask[i:i + size], params, row_keys=keys[i:i + size])
                 for i in range(0, len(ids), size)]
        if pad or self.world_size > 1 or len(parts) > 1:  # concatenated batches need one width
            width = params.max_new_tokens
        else:
            width = parts[0].responses.shape[1]
        out = GenerationOutput(
            prompts=torch.cat([p.prompts for p in parts]), prompt_mask=torch.cat([p.prompt_mask for p in parts]),
            responses=torch.cat([pad_columns(p.responses, width, self.tokenizer.pad_token_id) for p in parts]),
            response_mask=torch.cat([pad_columns(p.response_mask, width, 0) for p in parts]),
            log_probs=torch.cat([pad_columns(p.log_probs, width, 0.0) for p in parts]))
        return assemble_rollout(prompts, out, params.n, self.tokenizer)

    @register(Dispatch.DP_SPLIT)
    def compute_log_probs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.actor.compute_log_probs(batch, self.cfg.rollout.log_prob_micro_batch_size)

    @register(Dispatch.DP_SPLIT)
    def compute_ref_log_probs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.reference.compute_ref_log_probs(batch)

    @register(Dispatch.DP_SPLIT)
    def update_actor(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        return self.actor.update(batch, step)

    @register(Dispatch.ONE_TO_ALL)
    def save(self, directory: str) -> None:
        self.engine.save(Path(directory) / "actor")

    @register(Dispatch.ONE_TO_ALL)
    def load(self, directory: str) -> None:
        self.engine.load(Path(directory) / "actor")

    @register(Dispatch.RANK_ZERO)
    def export_hf(self, path: str) -> str:
        """The actor as an HF checkpoint (every rank gathers; rank 0 writes)."""
        weights = self.engine.hf_state_dict()
        if self.rank != 0:
            return path
        tok_dir = Path(self.cfg.model.tokenizer_path or self.cfg.model.path)
        extra = tuple(tok_dir / f for f in TOKENIZER_FILES if (tok_dir / f).is_file())
        hf_config = self.model_cfg.to_hf_dict()
        hf_config["torch_dtype"] = self.cfg.model.dtype
        return str(save_hf_checkpoint(weights, hf_config, path, extra_files=extra))


class CriticWorker(Worker):
    """The value model: per-token values and the clipped value update."""

    def __init__(self, cfg: Config):
        self.init_process_group()
        prepare_process(self)
        torch.manual_seed(cfg.trainer.seed)
        path = cfg.critic.model_path or cfg.model.path
        self.engine = build_engine(cfg, path, cfg.critic.optim, cfg.critic.parallel, value_head=True)
        self.critic = Critic(cfg.critic, self.engine, mini_batch_size=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                             seed=cfg.trainer.seed)

    @register(Dispatch.DP_SPLIT)
    def compute_values(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.critic.compute_values(batch)

    @register(Dispatch.DP_SPLIT)
    def update_critic(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        return self.critic.update(batch, step)

    @register(Dispatch.ONE_TO_ALL)
    def save(self, directory: str) -> None:
        self.engine.save(Path(directory) / "critic")

    @register(Dispatch.ONE_TO_ALL)
    def load(self, directory: str) -> None:
        self.engine.load(Path(directory) / "critic")


class RewardModelWorker(Worker):
    """An HF sequence classifier scoring (prompt, response) pairs, on the devices of placement.reward."""

    def __init__(self, cfg: Config):
        from hybridflow.utils import load_hf_model

        prepare_process(self)
        self.cfg = cfg.reward
        self.model = load_hf_model(cfg.reward.model_path, device_map="auto")

    @register(Dispatch.DP_SPLIT)
    def score(self, pairs: dict[str, list]) -> dict[str, torch.Tensor]:
        """{"prompt": [...], "response": [...]} -> {"score": FloatTensor[rows]}."""
        scores = self.model.score(list(zip(pairs["prompt"], pairs["response"])), batch_size=self.cfg.micro_batch_size)
        return {"score": torch.tensor(scores, dtype=torch.float32)}
