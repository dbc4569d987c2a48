"""Small helpers shared across layers."""
from __future__ import annotations

import difflib
from typing import Iterable, Optional


def nearest_name(name: str, choices: Iterable[str], cutoff: float = 0.5,
                 ignore_case: bool = False) -> Optional[str]:
    """The choice closest to a mistyped `name` (for "did you mean" hints), or None."""
    choices = list(choices)
    if ignore_case:
        lowered = {c.lower(): c for c in choices}
        match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=cutoff)
        return lowered[match[0]] if match else None
    match = difflib.get_close_matches(name, choices, n=1, cutoff=cutoff)
    return match[0] if match else None
