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
    """What runs: the node order and each node's inputs and outputs (the declared edges, none left out)."""
    order: tuple[str, ...]                   # topological; ties keep the order nodes were added
    source: str
    sinks: tuple[str, ...]
    inputs: dict[str, tuple[str, ...]]   # node -> upstream nodes: every declared edge, in declaration order
    outputs: dict[str, tuple[str, ...]]  # node -> downstream nodes
