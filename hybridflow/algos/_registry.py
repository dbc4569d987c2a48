"""Name -> function tables that configs select from (advantages, losses, KL).

Each algorithm module owns a plain dict and exposes `register_*` / `get_*`
built from the two helpers here, so every table fails the same way: an unknown
name raises KeyError naming it and the nearest registered name.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from hybridflow.common import nearest_name

F = TypeVar("F", bound=Callable)


def make_register(table: dict[str, Callable], what: str) -> Callable[[str], Callable[[F], F]]:
    """A decorator factory `register(name)` that adds a function to `table`."""

    def register(name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            # Silently replacing an entry would make a config run a different
            # algorithm depending on import order.
            if name in table:
                raise ValueError(f"{what} {name!r} is already registered")
            table[name] = fn
            return fn

        return add

    return register


def lookup(table: dict[str, Callable], name: str, what: str) -> Callable:
    """`table[name]`, or KeyError naming `name` and the nearest registered name."""
    if name in table:
        return table[name]
    # Compare case-insensitively so "GRPO" points at "grpo".
    nearest = nearest_name(name, table, cutoff=0.0, ignore_case=True)
    hint = f"; nearest registered: {nearest!r}" if nearest else ""
    raise KeyError(f"unknown {what} {name!r}{hint} (registered: {', '.join(sorted(table))})")
