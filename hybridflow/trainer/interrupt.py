"""Ctrl-C during training: the first one stops cleanly, the second abandons the step.

A training run is interrupted at a step boundary: the first SIGINT is only
noted (one line on stderr), the loop finishes the step it is in, saves it,
and returns. A second SIGINT raises KeyboardInterrupt at once and the step
is abandoned, except inside a `critical()` section (a checkpoint being
written, published or pruned), which it lets finish first, so nothing is
left half-written either way. Ray's own processes block SIGINT, so the
workers finish the step undisturbed; the controller shuts them down.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from hybridflow.common import SigintHandler


class GracefulInterrupt(SigintHandler):
    """SIGINT handling for the span of a `with` block (main thread only; elsewhere it is inert)."""

    def __init__(self, message: str = "finishing this step, then stopping (Ctrl-C again to abandon it)"):
        self.message = message
        self.requested = False
        self._critical = 0
        self._deferred = False

    def _on_sigint(self, signum, frame) -> None:
        if not self.requested:
            self.requested = True
            print(f"hybridflow: interrupted: {self.message}", file=sys.stderr, flush=True)
            return
        if self._critical:
            self._deferred = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def critical(self) -> Iterator[None]:
        """A section a second Ctrl-C does not cut short; its KeyboardInterrupt comes after."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
            if not self._critical and self._deferred:
                self._deferred = False
                raise KeyboardInterrupt
