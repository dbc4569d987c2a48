"""Prompt encoding, one rule each: render chat messages, decide the special tokens, left-pad ids for generation.

    text = render_prompt(tokenizer, messages, chat=tokenizer.has_chat_template)
    ids = encode_prompts(tokenizer, [text], chat=tokenizer.has_chat_template)
    input_ids, attention_mask = left_pad(ids, tokenizer.pad_token_id)      # LongTensor[B, T] each

The prompt dataset, the agent loop, `load_hf_model`'s `CausalLM` (and the
reward model's special-token choice) and the benchmarks all feed prompts to a
model through these, so a prompt is the same ids whichever of them built it.
`tokenizer` is anything with the `data.tokenizer.Tokenizer` methods used here
(`apply_chat_template`, `encode_batch`); nothing here imports it, so that
`Tokenizer.render_prompt` can use `render_prompt`.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

__all__ = ["adds_special_tokens", "encode_prompts", "left_pad", "render_prompt"]


def render_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]], chat: bool) -> str:
    """The prompt text of `messages`: with `chat`, the chat template with the generation prompt appended;
    else the messages' contents joined by newlines, no roles and no markers (base models, and the built-in
    arithmetic task, whose prompt is one user message such as "042+917=")."""
    if chat:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return "\n".join(str(m["content"]) for m in messages)


def adds_special_tokens(chat: bool) -> bool:
    """Whether a prompt's text is encoded with the tokenizer's BOS/EOS rule: not when a chat template
    rendered it, since the template writes its special tokens (BOS included) as text, and adding them again
    would put a second BOS before the first (transformers' `apply_chat_template(tokenize=True)` does the
    same); a plain-text prompt gets them as the tokenizer's config says."""
    return not chat


def encode_prompts(tokenizer: Any, texts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of prompt `texts` rendered by `render_prompt` with the same `chat`."""
    return tokenizer.encode_batch(list(texts), add_special_tokens=adds_special_tokens(chat))


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, pad_to: Optional[int] = None,
             device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids as a generation batch: input_ids [B, T] (pad_id on the left) and attention_mask [B, T]
    (1 on real tokens), both LongTensor on `device` (None: the CPU).

    T is the longest row, or `pad_to` (equal shapes on every rank); an empty row is all padding. Raises
    ValueError for no rows or a row longer than `pad_to`.
    """
    if not rows:
        raise ValueError("no prompts to pad")
    longest = max(len(r) for r in rows)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)
