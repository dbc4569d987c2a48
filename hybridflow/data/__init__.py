"""Prompt data: batch field names, tokenizers, prompt datasets and the built-in task.

``fields`` names every batch entry; ``Tokenizer`` wraps tokenizer.json or
SentencePiece files; ``hybridflow.data.prompts`` renders, encodes and
left-pads prompts for every caller; ``PromptDataset`` reads verl-style
parquet/jsonl prompt sets; ``hybridflow.data.arithmetic`` (imported on its own, it is also a CLI)
generates the built-in addition task.
"""
from hybridflow.data import fields
from hybridflow.data.dataset import (
    DatasetError,
    PromptDataset,
    PromptRecord,
    batches_per_epoch,
    collate_prompts,
    iterate_batches,
    read_rows,
    write_parquet,
)
from hybridflow.data.tokenizer import Tokenizer, build_char_tokenizer

__all__ = ["fields", "Tokenizer", "build_char_tokenizer", "DatasetError", "PromptDataset", "PromptRecord",
           "collate_prompts", "iterate_batches", "batches_per_epoch", "read_rows", "write_parquet"]
