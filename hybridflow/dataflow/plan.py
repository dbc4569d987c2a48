"""What a checked DataFlow runs (`Plan`) and the error a malformed flow raises.

A leaf module: `flow.py` builds plans and `execute.py` runs them; both import
these names from here, so neither imports the other at module level.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DataFlowError", "Plan"]


class DataFlowError(ValueError):
    """The flow's nodes or edges do not form a runnable DataFlow."""


@dataclass(frozen=True)
class Plan:
    """What runs: the node order and each node's effective inputs and outputs."""
    order: tuple[str, ...]                   # topological; ties keep the order nodes were added
    source: str
    sinks: tuple[str, ...]
    inputs: dict[str, tuple[str, ...]]       # node -> upstream nodes, in declaration order
    outputs: dict[str, tuple[str, ...]]      # node -> downstream nodes
    superseded: tuple[tuple[str, str], ...]  # declared shortcut edges left out
