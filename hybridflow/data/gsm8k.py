"""The GSM8K copy that ships with hybridflow (`hybridflow/assets/gsm8k/`, MIT), found and read.

A split is `DIR/{split}.jsonl` or, as shipped, `DIR/{split}.jsonl.gz`; readers take either, so a user's own
uncompressed copy works the same. `tools/prepare_gsm8k.py` turns it into verl-style parquet prompt files.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterator

GSM8K_DIR = Path(__file__).resolve().parents[1] / "assets" / "gsm8k"
SPLITS = ("train", "test")


def split_file(directory: str | Path, split: str) -> Path:
    """`DIR/{split}.jsonl` if present, else `DIR/{split}.jsonl.gz`; FileNotFoundError naming both if neither."""
    directory = Path(directory)
    for name in (f"{split}.jsonl", f"{split}.jsonl.gz"):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"GSM8K {split} split not found: neither {directory / f'{split}.jsonl'} "
                            f"nor {directory / f'{split}.jsonl.gz'} exists")


def read_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a jsonl file, gzipped when its name ends in .gz; blank lines skipped."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line


def records(directory: str | Path = GSM8K_DIR, split: str = "train") -> Iterator[dict[str, Any]]:
    """The split's objects (`question`, `answer`), in file order."""
    for _, line in read_lines(split_file(directory, split)):
        yield json.loads(line)


def questions(n: int | None = None, directory: str | Path = GSM8K_DIR, split: str = "train") -> list[str]:
    """The first `n` questions of a split (all when n is None)."""
    out = []
    for record in records(directory, split):
        if n is not None and len(out) >= n:
            break
        out.append(record["question"])
    return out
