"""The rollout role: this rank's prompts -> the rollout batch, with the built-in generator.

The generator is passed in (rule 6, docs/conventions.md): in the hybrid layout its weights
are views of the actor engine's parameters; on a rollout group placed apart
from training it owns a copy, refreshed from the actor before each rollout.
With an `env` section the rollout is multi-turn (`rollout/agent.py`): the same
batch fields, RESPONSES holding the whole trajectory, RESPONSE_MASK only the
model's tokens, ATTENTION_MASK every token, ENV_REWARDS the environment's
rewards and RESPONSE_TEXT the last model turn (the answer a rule reward reads).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from hybridflow.algos.overlong import truncated_rows
from hybridflow.config.schema import EnvConfig, RolloutConfig
from hybridflow.data import fields as F
from hybridflow.data.batch import chunk_rows, repeat_rows, slice_rows
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.envs import load_env_factory
from hybridflow.errors import ConfigError
from hybridflow.rollout import GenerationOutput, Generator, SamplingParams
from hybridflow.rollout.agent import AgentLimits, AgentLoop, AgentOutput, TemplateError
from hybridflow.common import mix_seed

Batch = dict[str, Any]


# What a rollout is for, which sets its sampling: the training samples (rollout.temperature, top-p/k, n),
# validation (rollout.val_temperature, one sample) or the ReMax baseline (greedy, one sample per prompt).
TRAIN, VALIDATION, BASELINE = "train", "validation", "baseline"
MODES = (TRAIN, VALIDATION, BASELINE)


def sampling_params(cfg: RolloutConfig, max_new_tokens: int, tokenizer: Tokenizer,
                    mode: str = TRAIN, more_stops: tuple[int, ...] = ()) -> SamplingParams:
    stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None) + more_stops
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, stop=tuple(cfg.stop))
    if mode == VALIDATION:
        return SamplingParams(temperature=cfg.val_temperature, do_sample=cfg.val_temperature > 0, n=1, **common)
    if mode == BASELINE:
        return SamplingParams(temperature=0.0, do_sample=False, n=1, **common)
    if mode != TRAIN:
        raise ValueError(f"rollout mode must be one of {MODES}, got {mode!r}")
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, do_sample=cfg.do_sample,
                          n=cfg.n, **common)


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad [B, R] to [B, width] so every rank returns the same shape."""
    if t.shape[1] >= width:
        return t
    return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), value)], dim=1)


def pad_routes(routes: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad ROUTES [B, T+R, L, k] with -1 (nothing routed) to [B, width, L, k]."""
    return torch.nn.functional.pad(routes, (0, 0, 0, 0, 0, width - routes.shape[1]), value=-1)


def response_texts(responses: torch.Tensor, mask: torch.Tensor, tokenizer: Tokenizer) -> list[str]:
    """The text of each response's masked-in tokens; rows are read as lists once (indexing each row's
    tensor is far slower)."""
    return tokenizer.batch_decode([t for t, keep in zip(row, kept) if keep]
                                  for row, kept in zip(responses.tolist(), mask.bool().tolist()))


def assemble_rollout(prompts: Batch, out: GenerationOutput, n: int, tokenizer: Tokenizer) -> Batch:
    """The training batch for B prompts x n samples: ids [B*n, T+R] and per-row lists."""
    batch: Batch = {
        F.PROMPTS: out.prompts,
        F.RESPONSES: out.responses,
        F.RESPONSE_MASK: out.response_mask,
        F.ROLLOUT_LOG_PROBS: out.log_probs,
        **({} if out.routes is None else {F.ROUTES: out.routes}),  # an MoE model's, where recorded
        F.INPUT_IDS: torch.cat([out.prompts, out.responses], dim=1),
        F.ATTENTION_MASK: torch.cat([out.prompt_mask, out.response_mask], dim=1),
        F.RESPONSE_TEXT: response_texts(out.responses, out.response_mask, tokenizer),
        F.UID: repeat_rows([str(i) for i in prompts[F.INDEX]], n),
    }
    for key in (F.DATA_SOURCE, F.GROUND_TRUTH, F.EXTRA_INFO, F.INDEX, F.PROMPT_TEXT):
        batch[key] = repeat_rows(prompts[key], n)
    return batch


def part_rows(prompts: Batch, start: int, stop: int, out: GenerationOutput, n: int, tokenizer: Tokenizer) -> Batch:
    """What a reward reads (`roles.scoring.batch_rows`) of the rows that prompts [start, stop) gave in `out`:
    equal to those rows of the assembled batch (`assemble_rollout`)."""
    part = {key: repeat_rows(slice_rows(prompts[key], start, stop), n)
            for key in (F.DATA_SOURCE, F.GROUND_TRUTH, F.EXTRA_INFO, F.PROMPT_TEXT)}
    part[F.RESPONSE_TEXT] = response_texts(out.responses, out.response_mask, tokenizer)
    return part


class Rollout:
    """Generation for one rank.

    cfg: the `rollout` section; max_new_tokens: `data.max_response_length`;
    world_size: generation replicas whose outputs are concatenated (they need one width).
    """

    def __init__(self, cfg: RolloutConfig, max_new_tokens: int, generator: Generator, tokenizer: Tokenizer,
                 world_size: int, env: Optional[EnvConfig] = None):
        self.cfg, self.generator, self.tokenizer, self.world_size = cfg, generator, tokenizer, world_size
        self.max_new_tokens = max_new_tokens
        self.agent, stops = None, ()
        if env is not None and env.function is not None:
            self.agent, stops = agent_loop(env, generator, tokenizer, max_new_tokens)
        self.sampling = {mode: sampling_params(cfg, max_new_tokens, tokenizer, mode, more_stops=stops)
                         for mode in MODES}

    def generate(self, prompts: Batch, seed: int, mode: str = TRAIN, pad: bool = False,
                 on_part: Optional[Callable[[Batch], None]] = None) -> Batch:
        """This rank's prompts -> the rollout batch (fields in `data.fields`); `mode` one of MODES.

        Responses are padded to max_new_tokens when batches are concatenated
        (several ranks or chunks, or `pad`), else to the longest one.
        `on_part`: called with each generated chunk's rows as a reward reads
        them (`part_rows`), in order, before the next chunk generates (a
        multi-turn rollout is one loop: it calls nothing).
        """
        if mode not in self.sampling:
            raise ValueError(f"rollout mode must be one of {MODES}, got {mode!r}")
        params = self.sampling[mode]
        ids, mask = prompts[F.INPUT_IDS], prompts[F.ATTENTION_MASK]
        # Noise keyed by (seed, dataset row, sample): a prompt's samples do not
        # depend on the rank, chunk or batch it is generated in.
        keys = mix_seed(seed, torch.as_tensor(prompts[F.INDEX], dtype=torch.long))
        if self.agent is not None:
            return self._agent_generate(prompts, keys, params, pad)
        # rollout.batch_size_per_device: generate this rank's prompts that many at a time.
        size = self.cfg.batch_size_per_device or len(ids)
        parts = []
        for start, c in zip(range(0, len(ids), size), chunk_rows({"ids": ids, "mask": mask, "keys": keys}, size)):
            parts.append(self.generator.generate(c["ids"], c["mask"], params, row_keys=c["keys"]))
            if on_part is not None:
                on_part(part_rows(prompts, start, start + len(c["ids"]), parts[-1], params.n, self.tokenizer))
        if pad or self.world_size > 1 or len(parts) > 1:  # concatenated batches need one width
            width = params.max_new_tokens
        else:
            width = parts[0].responses.shape[1]
        pad_id = self.tokenizer.pad_token_id
        out = GenerationOutput(
            prompts=torch.cat([p.prompts for p in parts]), prompt_mask=torch.cat([p.prompt_mask for p in parts]),
            responses=torch.cat([pad_columns(p.responses, width, pad_id) for p in parts]),
            response_mask=torch.cat([pad_columns(p.response_mask, width, 0) for p in parts]),
            log_probs=torch.cat([pad_columns(p.log_probs, width, 0.0) for p in parts]),
            routes=None if parts[0].routes is None else torch.cat([pad_routes(p.routes, ids.shape[1] + width)
                                                                   for p in parts]))
        batch = assemble_rollout(prompts, out, params.n, self.tokenizer)
        batch[F.TRUNCATED] = truncated_rows(out.responses, out.response_mask, params.max_new_tokens,
                                            params.stop_token_ids)  # DAPO's overlong filter reads it
        return row_figures(batch)

    def _agent_generate(self, prompts: Batch, keys: torch.Tensor, params: SamplingParams, pad: bool) -> Batch:
        """This rank's prompts as multi-turn trajectories (all of them in one loop: its turns are batched)."""
        ids, mask = prompts[F.INPUT_IDS], prompts[F.ATTENTION_MASK]
        rows = [{"prompt": raw[-1]["content"], "ground_truth": truth, "extra_info": extra}
                for raw, truth, extra in zip(prompts[F.RAW_PROMPT], prompts[F.GROUND_TRUTH], prompts[F.EXTRA_INFO])]
        out = self.agent.run([row[m.bool()].tolist() for row, m in zip(ids, mask)], keys, params, rows)
        return row_figures(agent_batch(prompts, out, params.n, self.tokenizer,
                                       self.max_new_tokens if pad or self.world_size > 1 else None))


def row_figures(batch: Batch) -> Batch:
    """`batch` with what the driver reads of its token tensors, one number a row: RESPONSE_LENGTH, and
    ENV_SCORES where an environment rewarded the turns (the tensors may then stay where they were made)."""
    batch[F.RESPONSE_LENGTH] = batch[F.RESPONSE_MASK].sum(-1)
    if F.ENV_REWARDS in batch:
        batch[F.ENV_SCORES] = batch[F.ENV_REWARDS].float().sum(-1)
    return batch


def agent_loop(env: EnvConfig, backend: Any, tokenizer: Tokenizer, max_total_tokens: int
               ) -> tuple[AgentLoop, tuple[int, ...]]:
    """The multi-turn loop the `env` section describes, and the ids of env.stop_tokens; ConfigError naming
    the key for a stop token that is not one token, or a chat template that cannot host tool turns."""
    stops = []
    for text in env.stop_tokens:
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            raise ConfigError("env.stop_tokens", f"{text!r} is not one token of the vocabulary at "
                                                 f"{tokenizer.name_or_path}")
        stops.append(token_id)
    limits = AgentLimits(env.max_turns, env.max_turn_tokens, max_total_tokens)
    try:
        return AgentLoop(backend, tokenizer, load_env_factory(env.function), limits), tuple(stops)
    except TemplateError as exc:
        raise ConfigError("env.function", f"the chat template at {tokenizer.name_or_path} cannot host tool turns: "
                                          f"{exc}") from None


def agent_batch(prompts: Batch, out: AgentOutput, n: int, tokenizer: Tokenizer, width: Optional[int]) -> Batch:
    """The training batch of B prompts x n trajectories, responses right-padded to `width` (None: the longest)."""
    width = width or max(len(t.ids) for t in out.trajectories)
    parts = out.tensors(width, tokenizer.pad_token_id)
    gen = GenerationOutput(prompts=prompts[F.INPUT_IDS].repeat_interleave(n, 0),
                           prompt_mask=prompts[F.ATTENTION_MASK].long().repeat_interleave(n, 0),
                           responses=parts["ids"], response_mask=parts["mask"], log_probs=parts["log_probs"])
    batch = assemble_rollout(prompts, gen, n, tokenizer)
    batch[F.ATTENTION_MASK] = torch.cat([gen.prompt_mask, parts["real"]], dim=1)  # tool tokens are attended to
    batch[F.ENV_REWARDS] = parts["rewards"]
    batch[F.ENV_STATS] = [{**t.stats, "turns": t.turns, "ended": t.ended} for t in out.trajectories]
    batch[F.RESPONSE_TEXT] = [t.answer for t in out.trajectories]
    return batch
