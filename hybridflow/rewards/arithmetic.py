"""Verifier for the built-in zero-padded addition task (:mod:`hybridflow.data.arithmetic`).

The response is read as the run of ASCII digits at its start (leading
whitespace skipped); whatever follows — EOS text, padding, a newline, more
chatter — is ignored. Because the task's answers are fixed-width
(``digits + 1`` characters, e.g. ``"0959"``), the default comparison is exact
on the digit string: ``"959"`` or ``"00959"`` do not score. Emitting the fixed
width is part of the task, and an exact rule also stops a policy from
collecting reward for stray zeros. ``strict_padding=False`` compares the
values instead (``"959"`` == ``"0959"``).

The chat form of the task (data_source ``"arithmetic_chat"``) asks an
instruct model in words and accepts prose: :func:`chat_arithmetic_reward`
scores the *last* integer in the response (``"17 + 25 = 42"`` scores, so does
``"42"``), and :func:`mentions_answer` is the lenient reading used to check that
a gain is not only formatting: the answer anywhere among the response's
integers.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["leading_digits", "compute_score", "arithmetic_reward", "integers", "chat_arithmetic_reward",
           "mentions_answer"]

_LEADING_DIGITS = re.compile(r"\s*([0-9]*)")
_INTEGER = re.compile(r"(?<![\d.])-?\d+(?![\d.]*\d)")


def leading_digits(solution_str: str) -> str:
    """The ASCII digits at the start of ``solution_str`` (after whitespace)."""
    match = _LEADING_DIGITS.match(solution_str)
    return match.group(1) if match else ""


def compute_score(solution_str: str, ground_truth: Any, strict_padding: bool = True) -> float:
    """1.0 when the response's leading digits equal ``ground_truth``, else 0.0."""
    truth = str(ground_truth).strip()
    if not truth.isascii() or not truth.isdigit():
        raise ValueError(f"arithmetic ground truth must be a string of digits, got {ground_truth!r}")
    answer = leading_digits(solution_str)
    if not answer:
        return 0.0
    if strict_padding:
        return 1.0 if answer == truth else 0.0
    return 1.0 if int(answer) == int(truth) else 0.0


def arithmetic_reward(data_source: str, solution_str: str, ground_truth: Any,
                      extra_info: dict[str, Any] | None = None) -> float:
    """Registry entry "arithmetic": exact fixed-width match, 1.0 / 0.0."""
    return compute_score(solution_str, ground_truth)


def integers(text: str) -> list[int]:
    """The whole integers written in ``text``, in order (the parts of "3.5" are not integers)."""
    return [int(m) for m in _INTEGER.findall(text)]


def chat_arithmetic_reward(data_source: str, solution_str: str, ground_truth: Any,
                           extra_info: dict[str, Any] | None = None) -> float:
    """Registry entry "arithmetic_chat": 1.0 when the last integer of the response is the sum."""
    found = integers(solution_str)
    return 1.0 if found and found[-1] == int(str(ground_truth).strip()) else 0.0


def mentions_answer(data_source: str, solution_str: str, ground_truth: Any,
                    extra_info: dict[str, Any] | None = None) -> float:
    """Registry entry "arithmetic_chat_lenient": 1.0 when the sum is any integer of the response."""
    return 1.0 if int(str(ground_truth).strip()) in integers(solution_str) else 0.0
