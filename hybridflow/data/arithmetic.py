"""The built-in verifiable task: zero-padded multi-digit addition.

A prompt is two ``digits``-wide zero-padded numbers, e.g. ``"042+917="``, and
the answer is their sum zero-padded to ``digits + 1`` characters (``"0959"``),
so every answer has the same length and a tiny character-level model can learn
the task in minutes on a CPU. Rows follow the verl convention that
:class:`hybridflow.data.dataset.PromptDataset` reads (data_source
``"arithmetic"``, ``reward_model.ground_truth`` = the answer string) and are
scored by :mod:`hybridflow.rewards.arithmetic`.

``--chat`` writes the same problems as a question to an instruct model
instead (data_source ``"arithmetic_chat"``): ``"What is 17 + 25? Answer with
the number only."``, whose answer is the plain sum (``"42"``), scored on the
last integer of the response (:func:`hybridflow.rewards.arithmetic.chat_arithmetic_reward`).

``--tool`` writes products the model is to compute with a calculator tool
(``"What is 347 * 68?"``, 3-digit by 2-digit: beyond a small model's mental
arithmetic), each prompt opening with a system message that names the tool
call format and one worked example; data_source ``"arithmetic_chat"`` (the
last integer is the answer). The multi-turn demo (`make demo-agent`) trains on
them with the calculator environment (:mod:`hybridflow.envs`).

Usage::

    python -m hybridflow.data.arithmetic --out data/arith --train 2000 --test 200 --digits 3 --seed 0
    python -m hybridflow.data.arithmetic --out data/addition-chat --train 4000 --test 200 --digits 2 --chat
    python -m hybridflow.data.arithmetic --out data/calculator --train 2000 --test 100 --tool
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any, Sequence

from hybridflow.data.dataset import write_parquet

__all__ = ["CHAT_DATA_SOURCE", "DATA_SOURCE", "TOOL_SYSTEM", "format_problem", "generate_arithmetic",
           "generate_splits", "generate_tool_splits", "write_parquet", "main"]

DATA_SOURCE = "arithmetic"
CHAT_DATA_SOURCE = "arithmetic_chat"
CHAT_QUESTION = "What is {a} + {b}? Answer with the number only."


def format_problem(a: int, b: int, digits: int) -> tuple[str, str]:
    """The prompt text and answer for ``a + b``: ``("042+917=", "0959")``."""
    if not (0 <= a < 10 ** digits and 0 <= b < 10 ** digits):
        raise ValueError(f"operands {a}, {b} do not fit in {digits} digits")
    return f"{a:0{digits}d}+{b:0{digits}d}=", f"{a + b:0{digits + 1}d}"


def _row(a: int, b: int, digits: int, split: str, index: int, chat: bool = False) -> dict[str, Any]:
    if chat:
        prompt, answer = CHAT_QUESTION.format(a=a, b=b), str(a + b)
    else:
        prompt, answer = format_problem(a, b, digits)
    return {
        "data_source": CHAT_DATA_SOURCE if chat else DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt}],
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "a": a, "b": b, "digits": digits},
    }


TOOL_SYSTEM = ('You can use a calculator: write <tool_call>{"name": "calculator", "arguments": {"expression": '
               '"..."}}</tool_call> and its result comes back. Then answer with the number.')
# One worked exchange in every prompt: a 135M instruct model rarely writes the call format from a description alone.
TOOL_EXAMPLE = [
    {"role": "user", "content": "What is 215 * 37?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "215 * 37"}}'
                                     '</tool_call>'},
    {"role": "tool", "content": "7955"},
    {"role": "assistant", "content": "215 * 37 = 7955"},
]


def generate_tool_splits(n_train: int, n_test: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and held-out products a * b (a: 3 digits, b: 2 digits) asked of a model with a calculator.

    Drawn without replacement from the 900 * 90 problems, as `generate_splits` draws its pairs.
    """
    if n_train + n_test > 900 * 90:
        raise ValueError(f"only {900 * 90} distinct 3-digit x 2-digit products exist, asked for {n_train + n_test}")
    codes = random.Random(seed).sample(range(900 * 90), n_train + n_test)
    rows = []
    for i, code in enumerate(codes):
        a, b = 100 + code // 90, 10 + code % 90
        split = "train" if i < n_train else "test"
        rows.append({
            "data_source": CHAT_DATA_SOURCE,
            "prompt": [{"role": "system", "content": TOOL_SYSTEM}, *TOOL_EXAMPLE,
                       {"role": "user", "content": f"What is {a} * {b}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": i if i < n_train else i - n_train, "a": a, "b": b},
        })
    return rows[:n_train], rows[n_train:]


def _sample_pairs(n: int, digits: int, seed: int) -> list[tuple[int, int]]:
    """``n`` distinct operand pairs, drawn without replacement."""
    if digits < 1:
        raise ValueError(f"digits must be at least 1, got {digits}")
    if n < 0:
        raise ValueError(f"number of problems must be non-negative, got {n}")
    size = 10 ** digits
    if n > size * size:
        raise ValueError(f"only {size * size} distinct {digits}-digit problems exist, asked for {n}")
    rng = random.Random(seed)  # stable across runs and platforms
    if size * size <= sys.maxsize:
        # Sampling from range() needs no list of all problems.
        codes = rng.sample(range(size * size), n)
    else:
        # range() cannot report a length this large; in such a space repeats
        # are vanishingly rare, so draw until n distinct codes are in hand.
        drawn: dict[int, None] = {}
        while len(drawn) < n:
            drawn.setdefault(rng.randrange(size * size), None)
        codes = list(drawn)
    return [divmod(code, size) for code in codes]


def generate_arithmetic(n: int, digits: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """``n`` distinct addition problems as dataset rows, deterministic in ``seed``."""
    return [_row(a, b, digits, split, i) for i, (a, b) in enumerate(_sample_pairs(n, digits, seed))]


def generate_splits(n_train: int, n_test: int, digits: int, seed: int,
                    chat: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and held-out rows: no prompt appears in both.

    Both splits come from one draw without replacement, so they are disjoint
    by construction rather than by filtering.
    """
    pairs = _sample_pairs(n_train + n_test, digits, seed)
    train = [_row(a, b, digits, "train", i, chat) for i, (a, b) in enumerate(pairs[:n_train])]
    test = [_row(a, b, digits, "test", i, chat) for i, (a, b) in enumerate(pairs[n_train:])]
    return train, test


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridflow.data.arithmetic",
        description="Write train/test parquet files of zero-padded addition problems.")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--train", type=int, default=2000, help="number of training problems")
    parser.add_argument("--test", type=int, default=200, help="number of held-out problems")
    parser.add_argument("--digits", type=int, default=3, help="digits per operand")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true",
                        help="ask as a question to an instruct model ('What is 17 + 25? ...'), plain sums")
    parser.add_argument("--tool", action="store_true",
                        help="3-digit x 2-digit products asked of a model with a calculator tool (--digits unused)")
    args = parser.parse_args(argv)
    try:
        if args.tool:
            train, test = generate_tool_splits(args.train, args.test, args.seed)
        else:
            train, test = generate_splits(args.train, args.test, args.digits, args.seed, args.chat)
    except ValueError as exc:
        parser.error(str(exc))
    for name, rows in (("train", train), ("test", test)):
        if rows:
            path = write_parquet(rows, args.out / f"{name}.parquet")
            print(f"wrote {len(rows)} {name} problems to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
