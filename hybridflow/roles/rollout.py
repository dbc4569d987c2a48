"""The rollout role: this rank's prompts -> the rollout batch, with the built-in generator.

The generator is passed in (rule 6, docs/conventions.md): in the hybrid layout its weights
are views of the actor engine's parameters; on a rollout group placed apart
from training it owns a copy, refreshed from the actor before each rollout.
"""
from __future__ import annotations

from typing import Any

import torch

from hybridflow.config.schema import RolloutConfig
from hybridflow.data import fields as F
from hybridflow.data.batch import chunk_rows, repeat_rows
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.rollout import GenerationOutput, Generator, SamplingParams
from hybridflow.utils import mix_seed

Batch = dict[str, Any]


def sampling_params(cfg: RolloutConfig, max_new_tokens: int, tokenizer: Tokenizer,
                    validation: bool = False) -> SamplingParams:
    stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, stop=tuple(cfg.stop))
    if validation:
        return SamplingParams(temperature=cfg.val_temperature, do_sample=cfg.val_temperature > 0, n=1, **common)
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, do_sample=cfg.do_sample,
                          n=cfg.n, **common)


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad [B, R] to [B, width] so every rank returns the same shape."""
    if t.shape[1] >= width:
        return t
    return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), value)], dim=1)


def response_texts(responses: torch.Tensor, mask: torch.Tensor, tokenizer: Tokenizer) -> list[str]:
    """The text of each response's masked-in tokens; rows are read as lists once (indexing each row's
    tensor cost about 20 us a row, 10 ms of a 512-row demo rollout)."""
    return tokenizer.batch_decode([t for t, keep in zip(row, kept) if keep]
                                  for row, kept in zip(responses.tolist(), mask.bool().tolist()))


def assemble_rollout(prompts: Batch, out: GenerationOutput, n: int, tokenizer: Tokenizer) -> Batch:
    """The training batch for B prompts x n samples: ids [B*n, T+R] and per-row lists."""
    batch: Batch = {
        F.PROMPTS: out.prompts,
        F.RESPONSES: out.responses,
        F.RESPONSE_MASK: out.response_mask,
        F.ROLLOUT_LOG_PROBS: out.log_probs,
        F.INPUT_IDS: torch.cat([out.prompts, out.responses], dim=1),
        F.ATTENTION_MASK: torch.cat([out.prompt_mask, out.response_mask], dim=1),
        F.RESPONSE_TEXT: response_texts(out.responses, out.response_mask, tokenizer),
        F.UID: repeat_rows([str(i) for i in prompts[F.INDEX]], n),
    }
    for key in (F.DATA_SOURCE, F.GROUND_TRUTH, F.EXTRA_INFO, F.INDEX, F.PROMPT_TEXT):
        batch[key] = repeat_rows(prompts[key], n)
    return batch


class Rollout:
    """Generation for one rank.

    cfg: the `rollout` section; max_new_tokens: `data.max_response_length`;
    world_size: generation replicas whose outputs are concatenated (they need one width).
    """

    def __init__(self, cfg: RolloutConfig, max_new_tokens: int, generator: Generator, tokenizer: Tokenizer,
                 world_size: int):
        self.cfg, self.generator, self.tokenizer, self.world_size = cfg, generator, tokenizer, world_size
        self.sampling = {False: sampling_params(cfg, max_new_tokens, tokenizer),
                         True: sampling_params(cfg, max_new_tokens, tokenizer, validation=True)}

    def generate(self, prompts: Batch, seed: int, validation: bool = False, pad: bool = False) -> Batch:
        """This rank's prompts -> the rollout batch (fields in `data.fields`).

        Responses are padded to max_new_tokens when batches are concatenated
        (several ranks or chunks, or `pad`), else to the longest one.
        """
        params = self.sampling[validation]
        ids, mask = prompts[F.INPUT_IDS], prompts[F.ATTENTION_MASK]
        # Noise keyed by (seed, dataset row, sample): a prompt's samples do not
        # depend on the rank, chunk or batch it is generated in.
        keys = mix_seed(seed, torch.as_tensor(prompts[F.INDEX], dtype=torch.long))
        # rollout.batch_size_per_device: generate this rank's prompts that many at a time.
        size = self.cfg.batch_size_per_device or len(ids)
        parts = [self.generator.generate(c["ids"], c["mask"], params, row_keys=c["keys"])
                 for c in chunk_rows({"ids": ids, "mask": mask, "keys": keys}, size)]
        if pad or self.world_size > 1 or len(parts) > 1:  # concatenated batches need one width
            width = params.max_new_tokens
        else:
            width = parts[0].responses.shape[1]
        pad_id = self.tokenizer.pad_token_id
        out = GenerationOutput(
            prompts=torch.cat([p.prompts for p in parts]), prompt_mask=torch.cat([p.prompt_mask for p in parts]),
            responses=torch.cat([pad_columns(p.responses, width, pad_id) for p in parts]),
            response_mask=torch.cat([pad_columns(p.response_mask, width, 0) for p in parts]),
            log_probs=torch.cat([pad_columns(p.log_probs, width, 0.0) for p in parts]))
        return assemble_rollout(prompts, out, params.n, self.tokenizer)
