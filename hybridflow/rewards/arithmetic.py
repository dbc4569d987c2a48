"""Verifier for the built-in zero-padded addition task (:mod:`hybridflow.data.arithmetic`).

The response is read as the run of ASCII digits at its start (leading
whitespace skipped); whatever follows — EOS text, padding, a newline, more
chatter — is ignored. Because the task's answers are fixed-width
(``digits + 1`` characters, e.g. ``"0959"``), the default comparison is exact
on the digit string: ``"959"`` or ``"00959"`` do not score. Emitting the fixed
width is part of the task, and an exact rule also stops a policy from
collecting reward for stray zeros. ``strict_padding=False`` compares the
values instead (``"959"`` == ``"0959"``).
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["leading_digits", "compute_score", "arithmetic_reward"]

_LEADING_DIGITS = re.compile(r"\s*([0-9]*)")


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
