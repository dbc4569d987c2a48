"""Generation on a Hugging Face `transformers` model's own code: the rollout engine of a model hybridflow's
decoder does not build (GPT-2, ...; `DecoderConfig.native` False).

    gen = HFGenerator(model, pad_token_id=tok.pad_token_id, tokenizer=tok)   # model: an HF *ForCausalLM
    out = gen.generate(input_ids, attention_mask, SamplingParams(max_new_tokens=64, n=4), row_keys=keys)

It samples as the built-in `Generator` samples (`sampling.sample`, the same keyed streams `row_streams`
per prompt and sample), so a prompt's tokens do not depend on the batch or rank that generates it, and on a
model both codes build the two engines give the same tokens (tests/rollout/test_hf_generate.py). The loop is
the plain one: left-padded prompts prefilled once with position ids counted from the mask, their KV cache
(transformers' own) repeated for the n samples, then one token per step for the live rows until all have
ended or `max_new_tokens` is reached. As in the built-in loop, an ended row is fed padding (its outputs
dropped) until a quarter of the live rows have ended, then those leave the batch and the cache in one copy,
so a long tail of responses is decoded at the cost of the rows still running. No C++ loop, no static path:
this engine is for architectures the fast ones do not cover.

Weights are the model's parameters, read at each call: the FSDP actor's switch to generation refills them
(`hybrid_engine/fsdp_gather.py`); `load_weights` copies (HF name, tensor) pairs for a caller with its own
copy. It implements the rollout interface (`backend.RolloutBackend`).
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable, Optional

import torch

from hybridflow.rollout.generator import GenerationOutput, generation_output, row_streams, decode_loop
from hybridflow.rollout.sampling import SamplingParams

__all__ = ["HFGenerator"]


class HFGenerator:
    """Batched sampling with a KV cache on an HF causal LM (see the module doc)."""

    def __init__(self, model: Any, pad_token_id: int, tokenizer: Any = None):
        self.model = model
        self.pad_token_id = pad_token_id
        self.tokenizer = tokenizer  # anything with .decode(list[int]) -> str; needed for stop strings
        # transformers 5 names the KV cache argument (and output) `cache`, earlier releases `past_key_values`
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (HF name, tensor) pairs into the model in place; the bytes taken. A tied checkpoint's
        `lm_head.weight` is the embedding again (skipped); any other name the model lacks is a KeyError."""
        params = dict(self.model.named_parameters())
        taken = 0
        for name, tensor in named:
            if name not in params:
                if name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
                    continue
                raise KeyError(f"weight {name!r} is not a tensor of this {type(self.model).__name__}")
            params[name].copy_(tensor)
            taken += tensor.numel() * tensor.element_size()
        return taken

    def release(self) -> None:
        """Nothing to free: the cache lives for one call."""

    def resume(self) -> None:
        """Nothing to take back (see `release`)."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: Optional[torch.Generator] = None,
                 row_keys: Optional[torch.Tensor] = None) -> GenerationOutput:
        """Up to `params.max_new_tokens` tokens after each left-padded prompt [B, T], B * n rows prompt-major;
        row_keys [B]: keyed sampling, as `Generator.generate`."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: HFGenerator(model, pad_token_id, tokenizer)")
        n, steps = params.n, params.max_new_tokens
        home, device = input_ids.device, next(self.model.parameters()).device
        ids, mask = input_ids.to(device), attention_mask.to(device).long()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         use_cache=True)
        cache, logits = out[self._cache_arg], out.logits[:, -1]
        if n > 1:  # each prompt's cache rows shared by its n samples: repeated, as the built-in prefill does
            cache.batch_repeat_interleave(n)
            logits, mask = logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        keys = row_streams(row_keys, n, steps, device)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        position = mask.sum(-1)  # the first new token's: the prompt's real tokens

        def next_logits(token: torch.Tensor) -> torch.Tensor:
            nonlocal cache, mask, position
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
                             use_cache=True, **{self._cache_arg: cache})
            cache, position = out[self._cache_arg], position + 1
            return out.logits[:, -1]

        def drop_rows(keep: torch.Tensor) -> None:  # ended rows leave the KV cache, the mask and the positions
            nonlocal mask, position
            cache.batch_select_indices(keep)
            mask, position = mask[keep], position[keep]

        tokens, log_probs, response_mask, length = decode_loop(
            logits, params, generator, keys, stop_ids, self.pad_token_id, self.tokenizer, next_logits, drop_rows)
        return generation_output(input_ids, attention_mask, n, home, tokens, log_probs, response_mask, length)
