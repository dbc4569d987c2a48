"""Rule-based verifier for GSM8K-style answers.

Two ways to find the model's answer in its response:

* ``strict``: the number right after the last ``####`` (the format GSM8K
  reference solutions use and the prompt asks for);
* ``flexible``: the last number anywhere in the response.

Numbers are normalised before comparison: commas, ``$`` and surrounding
whitespace are removed, a trailing period is dropped, and the values are
compared as ``Decimal`` so ``"72"``, ``"72.0"`` and ``"72.00"`` match and
``"1,000"`` equals ``"1000"``. Digit groups are recognised only as proper
thousands groups (``1,234,567``), so a list like ``"1,2,3"`` reads as three
numbers, not ``123``.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["extract_solution", "normalize_number", "compute_score", "gsm8k_reward", "gsm8k_flexible_reward"]

# A number: proper thousands groups are tried first so "1,000" is one number,
# plain digit runs cover the rest, then an optional fraction. A leading sign
# counts only when it does not follow a word or closing bracket, so the "-" of
# "10-3" is subtraction while "= -7" is negative; "$" may sit either side of it.
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = r"(?:(?<![\w)\]])[-+])?(?:\$\s*[-+]?)?(?:" + _DIGITS + ")"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"\s*(" + _NUMBER + ")")
_MARKER = "####"


def normalize_number(text: str) -> Decimal | None:
    """``text`` as a Decimal after dropping commas, ``$``, whitespace and a
    trailing period; None when it is not a finite number."""
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".").replace(" ", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer text found in ``solution_str``, or None when there is none."""
    if method == "strict":
        marker = solution_str.rfind(_MARKER)
        if marker < 0:
            return None
        match = _STRICT_RE.match(solution_str, marker + len(_MARKER))
        return match.group(1) if match else None
    if method == "flexible":
        numbers = _NUMBER_RE.findall(solution_str)
        return numbers[-1] if numbers else None
    raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")


def _matches(answer: str, ground_truth: str) -> bool:
    got, want = normalize_number(answer), normalize_number(ground_truth)
    if want is None:
        # A non-numeric reference cannot be compared as a number; fall back to
        # the cleaned text rather than scoring every response 0.
        return answer.strip() == ground_truth.strip()
    return got is not None and got == want


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the extracted answer equals ``ground_truth``, ``format_score``
    if an answer was found but is wrong, 0.0 if no answer was found."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if _matches(answer, str(ground_truth)) else float(format_score)


def gsm8k_reward(data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: dict[str, Any] | None = None) -> float:
    """Registry entry "gsm8k": strict extraction, 1.0 / 0.0."""
    return compute_score(solution_str, ground_truth, method="strict")


def gsm8k_flexible_reward(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict[str, Any] | None = None) -> float:
    """Registry entry "gsm8k_flexible": last number in the response, 1.0 / 0.0."""
    return compute_score(solution_str, ground_truth, method="flexible")
