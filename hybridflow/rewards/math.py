"""The `math` reward: competition-style answers judged equivalent by Hugging Face's `math-verify`.

The answer is the last `\\boxed{...}` of the response when there is one, else
the last LaTeX or plain expression `math-verify` finds; the ground truth is
read as LaTeX (`\\frac{1}{2}`, `[1, 2)`, `\\{1, 2\\}`) or a plain expression
(`1/2`). Equivalence (numbers, fractions, intervals, sets, symbolic forms,
percentages) is `math_verify.verify`'s: 1.0 when equivalent, else 0.0.

A sympy comparison can run for minutes on a hostile answer (a tower of
exponents), and math-verify's own limit uses `signal.alarm`, which works only
on a process's main thread; so its limit is off here and the caller bounds
the call: `rewards/scorer.py` always scores this reward in worker processes,
where a call past `reward.timeout_s` is killed and the row scores 0.
"""
from __future__ import annotations

import functools
import logging
import re
from typing import Any, Optional

__all__ = ["last_boxed", "math_reward", "MathVerifyMissing"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


class MathVerifyMissing(ImportError):
    """`math-verify` is not installed (it is an optional dependency: `pip install hybridflow[dev]`)."""


def last_boxed(text: str) -> Optional[str]:
    """The contents of the last `\\boxed{...}` (braces balanced), or None when there is none or it is open."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


class _OwnTimeout(logging.Filter):
    """Drops math-verify's notice that its own time limit is off: it is off on purpose (the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.lru_cache(maxsize=None)
def _verifier():
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_OwnTimeout())
    try:
        from math_verify import parse, verify
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    except ImportError as exc:
        raise MathVerifyMissing("the math reward needs the math-verify package: pip install 'math-verify>=0.9' "
                                "(it is in hybridflow's dev extra)") from exc
    return parse, verify, [LatexExtractionConfig(), ExprExtractionConfig()]


def math_reward(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: dict[str, Any] | None = None) -> float:
    """Registry entry "math": 1.0 when the response's answer is equivalent to `ground_truth`, else 0.0."""
    parse, verify, configs = _verifier()
    truth = str(ground_truth).strip()
    if not truth:
        raise ValueError("math ground truth is empty")
    if "$" not in truth and "\\boxed" not in truth:
        truth = f"${truth}$"  # math-verify reads LaTeX only between delimiters
    boxed = last_boxed(solution_str)
    answer = f"${boxed}$" if boxed is not None else solution_str
    gold = parse(truth, extraction_config=configs, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot read the ground truth {ground_truth!r}")
    predicted = parse(answer, extraction_config=configs, parsing_timeout=None)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0
