"""What one rank moves in a switch to generation, counted collective by collective.

The engine's gathers (`MegatronEngine.stage_state`, `each_stage`) and this
package's executors add to one `Traffic`; `generation.transition_metrics`
reports it as the `reshard/*` figures.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Traffic:
    """What one rank sent and received in a weight transfer, and the collectives it joined.

    Bytes are logical: what the collective delivers from this rank to others
    and from others to it (an all-gather over k ranks sends the own buffer to
    k - 1 peers; a broadcast's root sends it to every other member),
    whatever algorithm the backend runs underneath.
    """

    bytes_received: int = 0
    bytes_sent: int = 0
    collectives: int = 0

    def add(self, received: int, sent: int = 0) -> None:
        """One collective this rank joined."""
        self.bytes_received += received
        self.bytes_sent += sent
        self.collectives += 1
