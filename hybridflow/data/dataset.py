"""Prompt datasets in verl's column convention, read from parquet or jsonl.

Each row holds::

    prompt        list of chat messages {"role": str, "content": str}
    data_source   str, selects the reward function ("openai/gsm8k", "arithmetic")
    reward_model  {"ground_truth": ..., "style": "rule"}   (style optional)
    extra_info    dict, optional free-form metadata

:class:`PromptDataset` validates every row up front (a bad row fails the run
at start-up, naming ``file:line`` for jsonl, 1-based, or ``file:row N`` for
parquet, 0-based as pyarrow counts), renders the prompt (chat template or
plain text), tokenizes it and applies the overlong-prompt policy once, so an
epoch is only indexing. :func:`collate_prompts` left-pads a batch for
generation and :func:`iterate_batches` orders an epoch deterministically and
can resume at any (epoch, step).

Simplified on purpose: the whole dataset is held in memory (verl does the same
to filter overlong prompts); multimodal content is not supported.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.config.schema import DataConfig
from hybridflow.data import fields as F
from hybridflow.data.prompts import encode_prompts, left_pad, render_prompt
from hybridflow.data.tokenizer import Tokenizer

__all__ = ["DatasetError", "PromptDataset", "PromptRecord", "collate_prompts", "iterate_batches",
           "batches_per_epoch", "read_rows", "write_parquet", "OVERLONG_POLICIES"]

logger = logging.getLogger("hybridflow.data")

OVERLONG_POLICIES = ("filter", "truncate_left", "truncate_right", "error")
SUPPORTED_SUFFIXES = (".parquet", ".jsonl")


class DatasetError(ValueError):
    """A dataset file or row is unusable; the message names file and row."""


@dataclass(frozen=True)
class PromptRecord:
    """One validated, tokenized prompt. ``index`` is the row's position in the
    concatenated source files, counted before any filtering."""

    index: int
    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]
    prompt_text: str
    input_ids: tuple[int, ...]


# -- reading and writing rows ----------------------------------------------------

def read_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)`` for each row of a ``.parquet`` or ``.jsonl`` file.

    ``location`` is ``"file:line"`` (jsonl, 1-based, blank lines skipped) or
    ``"file:row N"`` (parquet, 0-based).
    """
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"{path} is a directory; list its {' or '.join(SUPPORTED_SUFFIXES)} files instead")
    if path.suffix not in SUPPORTED_SUFFIXES:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r} "
                           f"(supported: {', '.join(SUPPORTED_SUFFIXES)})")
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path)
        return
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read parquet ({exc})") from exc
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", row


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                                   f"column {exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            yield f"{path}:{lineno}", row


def write_parquet(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` (dicts in the convention above) to a parquet file atomically.

    The table goes to a temporary file beside ``path`` first and is then
    renamed over it, so readers never see a half-written file.
    """
    if not rows:
        raise ValueError(f"refusing to write an empty dataset to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([dict(r) for r in rows])
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# -- validation --------------------------------------------------------------------

def _validate_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(prompt, (list, tuple)):
        raise DatasetError(f"{where}: 'prompt' must be a list of chat messages, got {type(prompt).__name__}")
    if not prompt:
        raise DatasetError(f"{where}: empty prompt (no messages)")
    messages = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, Mapping):
            raise DatasetError(f"{where}: prompt message {i} must be a dict with 'role' and 'content', "
                               f"got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise DatasetError(f"{where}: prompt message {i} has no 'role' string")
        if not isinstance(content, str):
            raise DatasetError(f"{where}: prompt message {i} has no 'content' string")
        # Parquet fills struct fields missing from a row with nulls; drop them.
        messages.append({k: v for k, v in msg.items() if v is not None})
    if all(not m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: empty prompt (all message contents are blank)")
    return messages


def _validate_row(row: Any, where: str) -> tuple[list[dict[str, Any]], str, Any, dict[str, Any]]:
    """Check one raw row; returns (messages, data_source, ground_truth, extra_info)."""
    if not isinstance(row, Mapping):
        raise DatasetError(f"{where}: row must be an object, got {type(row).__name__}")
    if "prompt" not in row or row["prompt"] is None:
        raise DatasetError(f"{where}: missing 'prompt'")
    messages = _validate_messages(row["prompt"], where)
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise DatasetError(f"{where}: missing 'data_source' string")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
        raise DatasetError(f"{where}: missing 'reward_model.ground_truth'")
    ground_truth = reward_model["ground_truth"]
    if isinstance(ground_truth, bool):
        raise DatasetError(f"{where}: 'reward_model.ground_truth' must not be a boolean")
    if isinstance(ground_truth, (int, float)):
        ground_truth = str(ground_truth)  # verifiers compare text; 42 and "42" mean the same
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        raise DatasetError(f"{where}: 'extra_info' must be an object, got {type(extra_info).__name__}")
    return messages, data_source, ground_truth, dict(extra_info)


def _as_file_list(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [Path(f) for f in files]
    if not paths:
        raise DatasetError("no dataset files given")
    return paths


# -- the dataset -------------------------------------------------------------------

class PromptDataset:
    """Validated, tokenized prompts from one or more parquet/jsonl files.

    Reads ``cfg.max_prompt_length``, ``cfg.overlong_prompts`` (one of
    :data:`OVERLONG_POLICIES`) and ``cfg.apply_chat_template``. Prompts
    rendered through a chat template are encoded without adding special tokens
    (the template writes them); plain-text prompts get the tokenizer's usual
    BOS/EOS rule (both in :mod:`hybridflow.data.prompts`). Truncated prompts keep ``max_prompt_length`` tokens from the
    end (``truncate_left``, keeps the question's tail and the generation
    prompt) or the start (``truncate_right``); their ``prompt_text`` is the
    decoded kept tokens.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer,
                 files: str | os.PathLike | Sequence[str | os.PathLike]) -> None:
        if cfg.overlong_prompts not in OVERLONG_POLICIES:
            raise ValueError(
                f"overlong_prompts must be one of {OVERLONG_POLICIES}, got {cfg.overlong_prompts!r}")
        if cfg.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be positive, got {cfg.max_prompt_length}")
        self.files = _as_file_list(files)
        self.tokenizer = tokenizer
        self.max_prompt_length = cfg.max_prompt_length
        self.overlong_policy = cfg.overlong_prompts
        self.use_chat_template = cfg.apply_chat_template and tokenizer.has_chat_template
        if cfg.apply_chat_template and not tokenizer.has_chat_template:
            logger.info("tokenizer %s has no chat template; prompts are the messages' plain contents",
                        tokenizer.name_or_path)
        self.num_rows = 0
        self.num_overlong = 0
        self.records: list[PromptRecord] = self._load()

    def _load(self) -> list[PromptRecord]:
        rows, wheres = [], []
        for path in self.files:
            for where, raw in read_rows(path):
                rows.append(_validate_row(raw, where))
                wheres.append(where)
        self.num_rows = len(rows)
        if not rows:
            raise DatasetError(f"no rows in {', '.join(map(str, self.files))}")
        texts = [render_prompt(self.tokenizer, messages, self.use_chat_template) for messages, *_ in rows]
        all_ids = encode_prompts(self.tokenizer, texts, self.use_chat_template)
        records = []
        for index, ((messages, source, truth, extra), text, ids) in enumerate(zip(rows, texts, all_ids)):
            if len(ids) > self.max_prompt_length:
                self.num_overlong += 1
                if self.overlong_policy == "error":
                    raise DatasetError(f"{wheres[index]}: prompt is {len(ids)} tokens, longer than "
                                       f"max_prompt_length={self.max_prompt_length}")
                if self.overlong_policy == "filter":
                    continue
                keep = self.max_prompt_length
                ids = ids[-keep:] if self.overlong_policy == "truncate_left" else ids[:keep]
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
            if not ids:
                raise DatasetError(f"{wheres[index]}: prompt encodes to no tokens")
            records.append(PromptRecord(index, messages, source, truth, extra, text, tuple(ids)))
        self._report(records)
        return records

    def _report(self, records: list[PromptRecord]) -> None:
        names = ", ".join(str(f) for f in self.files)
        if self.num_overlong:
            action = {"filter": "dropped", "truncate_left": "truncated (kept the end)",
                      "truncate_right": "truncated (kept the start)"}[self.overlong_policy]
            logger.warning("%s: %d of %d prompts longer than max_prompt_length=%d tokens were %s",
                           names, self.num_overlong, self.num_rows, self.max_prompt_length, action)
        if not records:
            raise DatasetError(f"no usable prompts in {names}: all {self.num_rows} rows are longer than "
                               f"max_prompt_length={self.max_prompt_length} tokens and were filtered")
        logger.info("%s: loaded %d prompts (longest %d tokens)", names, len(records),
                    max(len(r.input_ids) for r in records))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise ValueError(f"tokenizer {self.tokenizer.name_or_path} has neither a pad nor an EOS token")
        return pad

    def collate(self, items: Sequence[PromptRecord], pad_to: int | None = None) -> dict[str, Any]:
        """:func:`collate_prompts` with this dataset's pad id."""
        return collate_prompts(items, self.pad_token_id, pad_to=pad_to)


# -- batching ----------------------------------------------------------------------

def collate_prompts(items: Sequence[PromptRecord], pad_token_id: int,
                    pad_to: int | None = None) -> dict[str, Any]:
    """Left-pad prompts into a generation batch.

    Returns INPUT_IDS, ATTENTION_MASK, POSITION_IDS as LongTensor[B, T] with
    ``T`` = the longest prompt (or ``pad_to``, for equal shapes on every
    device) and position 0 at each row's first real token, plus the lists
    PROMPT_TEXT, RAW_PROMPT, DATA_SOURCE, GROUND_TRUTH, EXTRA_INFO, INDEX.
    """
    if not items:
        raise ValueError("cannot collate an empty batch")
    input_ids, attention_mask = left_pad([r.input_ids for r in items], pad_token_id, pad_to=pad_to)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    return {
        F.INPUT_IDS: input_ids,
        F.ATTENTION_MASK: attention_mask,
        F.POSITION_IDS: position_ids,
        F.PROMPT_TEXT: [r.prompt_text for r in items],
        F.RAW_PROMPT: [r.messages for r in items],
        F.DATA_SOURCE: [r.data_source for r in items],
        F.GROUND_TRUTH: [r.ground_truth for r in items],
        F.EXTRA_INFO: [r.extra_info for r in items],
        F.INDEX: [r.index for r in items],
    }


def batches_per_epoch(num_items: int, batch_size: int, drop_last: bool = True) -> int:
    """How many batches :func:`iterate_batches` yields per epoch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return num_items // batch_size if drop_last else -(-num_items // batch_size)


def epoch_order(num_items: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order of item indices in ``epoch``: a permutation drawn from
    ``(seed, epoch)`` alone, so any epoch can be recomputed on resume."""
    if not shuffle:
        return np.arange(num_items)
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be non-negative, got seed={seed}, epoch={epoch}")
    return np.random.default_rng([seed, epoch]).permutation(num_items)


def iterate_batches(dataset: Sequence[PromptRecord], batch_size: int, shuffle: bool, seed: int, epoch: int,
                    drop_last: bool = True, start_step: int = 0) -> Iterator[list[PromptRecord]]:
    """Yield the batches of one epoch, starting at batch ``start_step``.

    The same ``(seed, epoch)`` always gives the same batches, so a run resumed
    at ``(epoch, step)`` continues exactly where it stopped. Training uses
    ``drop_last=True`` (every step sees ``batch_size`` prompts); a dataset
    smaller than one batch is then an error rather than an empty epoch.
    """
    total = batches_per_epoch(len(dataset), batch_size, drop_last)
    if total == 0:
        raise ValueError(f"dataset of {len(dataset)} prompts is smaller than batch_size={batch_size}")
    if not 0 <= start_step <= total:
        raise ValueError(f"start_step={start_step} is outside the epoch's {total} batches")
    order = epoch_order(len(dataset), shuffle, seed, epoch)
    for step in range(start_step, total):
        yield [dataset[int(i)] for i in order[step * batch_size:(step + 1) * batch_size]]
