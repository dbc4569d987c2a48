"""Convert the GSM8K jsonl files into hybridflow/verl prompt parquet files.

Each source line is ``{"question": ..., "answer": ...}`` where the answer is a
worked solution ending in ``#### <number>``. Each output row is::

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + INSTRUCTION}]
    reward_model  {"style": "rule", "ground_truth": final number, commas removed}
    extra_info    {"split", "index", "answer": full solution, "question"}

which :class:`hybridflow.data.dataset.PromptDataset` reads and
:mod:`hybridflow.rewards.gsm8k` scores. The source is the copy that ships in
the repository (``hybridflow/assets/gsm8k``, gzipped) by default; ``--src``
takes any directory with ``train.jsonl``/``test.jsonl``, plain or ``.gz``.

Usage::

    python tools/prepare_gsm8k.py --out data/gsm8k [--src DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from hybridflow.data.dataset import write_parquet
from hybridflow.data.gsm8k import GSM8K_DIR, SPLITS, read_lines, split_file
from hybridflow.rewards.gsm8k import normalize_number

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = " Let's think step by step and output the final answer after \"####\"."
DEFAULT_SRC = GSM8K_DIR


def _row(record: Any, where: str, split: str, index: int) -> dict[str, Any]:
    if not isinstance(record, dict) or not isinstance(record.get("question"), str) \
            or not isinstance(record.get("answer"), str):
        raise ValueError(f"{where}: expected an object with 'question' and 'answer' strings")
    solution = record["answer"]
    if "####" not in solution:
        raise ValueError(f"{where}: answer has no '#### <number>' final line")
    final = solution.rpartition("####")[2].strip().replace(",", "")
    if normalize_number(final) is None:
        raise ValueError(f"{where}: final answer {final!r} is not a number")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": record["question"] + INSTRUCTION}],
        "reward_model": {"style": "rule", "ground_truth": final},
        "extra_info": {"split": split, "index": index, "answer": solution, "question": record["question"]},
    }


def convert(src_file: str | Path, out_file: str | Path, split: str) -> int:
    """Convert one GSM8K jsonl file (plain or .gz) to parquet; returns the number of rows."""
    src = Path(src_file)
    if not src.is_file():
        raise FileNotFoundError(f"GSM8K source file not found: {src}")
    rows = []
    for lineno, line in read_lines(src):
        where = f"{src}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg})") from exc
        rows.append(_row(record, where, split, len(rows)))
    if not rows:
        raise ValueError(f"{src}: no rows")
    write_parquet(rows, out_file)
    return len(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, default=DEFAULT_SRC,
                        help=f"directory holding train.jsonl and test.jsonl, plain or .gz (default: {DEFAULT_SRC})")
    parser.add_argument("--out", type=Path, required=True,
                        help="directory for train.parquet and test.parquet")
    args = parser.parse_args(argv)
    for split in SPLITS:
        out = args.out / f"{split}.parquet"
        try:
            n = convert(split_file(args.src, split), out, split)
        except (FileNotFoundError, ValueError) as exc:
            print(f"prepare_gsm8k: error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {n} {split} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
