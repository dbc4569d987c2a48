"""The rollout role: this rank's prompts -> the rollout batch, with the built-in generator.

The generator is passed in (STYLE rule 6): in the hybrid layout its weights
are views of the actor engine's parameters; on a rollout group placed apart
from training it owns a copy, refreshed from the actor before each rollout.
"""
from __future__ import annotations

from typing import Any

import torch

from hybridflow.config.schema import Config
from hybridflow.data import fields as F
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.rollout import GenerationOutput, Generator, SamplingParams


def sampling_params(cfg: Config, tokenizer: Tokenizer, validation: bool = False) -> SamplingParams:
    r = cfg.rollout
    stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
    common = dict(max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids, stop=tuple(r.stop))
    if validation:
        return SamplingParams(temperature=r.val_temperature, do_sample=r.val_temperature > 0, n=1, **common)
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, do_sample=r.do_sample,
                          n=r.n, **common)


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad [B, R] to [B, width] so every rank returns the same shape."""
    if t.shape[1] >= width:
        return t
    return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), value)], dim=1)


class Rollout:
    def __init__(self, cfg: Config, generator: Generator, tokenizer: Tokenizer, world_size: int):
        self.cfg, self.generator, self.tokenizer, self.world_size = cfg, generator, tokenizer, world_size
        self.sampling = {False: sampling_params(cfg, tokenizer), True: sampling_params(cfg, tokenizer, True)}

    def generate(self, prompts: dict[str, Any], seed: int, validation: bool = False,
                 pad: bool = False) -> dict[str, Any]:
        """This rank's prompts -> the rollout batch (fields in `data.fields`).

        Responses are padded to max_new_tokens when batches are concatenated
        (several ranks or chunks, or `pad`), else to the longest one.
        """
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
        pad_id = self.tokenizer.pad_token_id
        out = GenerationOutput(
            prompts=torch.cat([p.prompts for p in parts]), prompt_mask=torch.cat([p.prompt_mask for p in parts]),
            responses=torch.cat([pad_columns(p.responses, width, pad_id) for p in parts]),
            response_mask=torch.cat([pad_columns(p.response_mask, width, 0) for p in parts]),
            log_probs=torch.cat([pad_columns(p.log_probs, width, 0.0) for p in parts]))
        return assemble_rollout(prompts, out, params.n, self.tokenizer)
