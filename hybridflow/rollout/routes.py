"""The experts a mixture-of-experts model chose while it generated: what the trainer replays (routing replay) and
compares its own choices with (the route mismatch), recorded where they are made.

    log = RouteLog(model, rows, prompt_width, steps)       # the generator builds one per generate call
    logits = log.prefill(lambda: model.forward_cached(...), n)
    next_logits, drop_rows = log.step(next_logits), log.drop(drop_rows)   # around the decode loop's callbacks
    routes = log.result(prompt_mask, response_mask, steps_run)            # [rows, T + R, layers, k]

`routes[r, c, l]` are the k experts layer l chose for column c of row r's sequence (the prompt's T columns, then
the response's), in the router's top-k order; -1 where nothing was routed: padding, and a row's last response
token when the loop did not feed it back (it was the decode's last step, or the row was dropped as ended). int16 (experts < 32768): a 4-layer, top-2 model's routes are 16 bytes a token.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn

__all__ = ["RouteLog", "moe_layers", "ROUTE_DTYPE"]

ROUTE_DTYPE = torch.int16


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder's MoE blocks in layer order (empty for a dense model)."""
    from hybridflow.models.decoder import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


class RouteLog:
    """One generate call's routes. rows: the output rows (prompts x n); prompt_width: T; steps: the most
    response tokens."""

    def __init__(self, model: nn.Module, rows: int, prompt_width: int, steps: int):
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("routes are recorded for a mixture-of-experts model; this one is dense")
        k = self.layers[0].cfg.moe_top_k
        device = model.embed.weight.device
        self.routes = torch.full((rows, prompt_width + steps, len(self.layers), k), -1, dtype=ROUTE_DTYPE,
                                 device=device)
        self.live = torch.arange(rows, device=device)  # the output row of each decode (cache) row
        self.column = prompt_width  # the sequence column the next fed token sits at

    @contextmanager
    def _capture(self) -> Iterator[list[list[Tensor]]]:
        taken: list[list[Tensor]] = [[] for _ in self.layers]
        for layer, out in zip(self.layers, taken):
            layer.routes_out = out
        try:
            yield taken
        finally:
            for layer in self.layers:
                layer.routes_out = None

    def prefill(self, run: Callable[[], Tensor], n: int, width: int) -> Tensor:
        """`run()` (the prefill of [b, width] prompts; its logits are returned) with every layer's routes kept
        for the prompt columns of each prompt's n rows."""
        with self._capture() as taken:
            logits = run()
        for layer, parts in enumerate(taken):
            (experts,) = parts  # one routing per layer: [b * width, k]
            experts = experts.view(-1, width, experts.shape[-1]).repeat_interleave(n, 0)
            self.routes[:, :width, layer] = experts.to(ROUTE_DTYPE)
        return logits

    def step(self, next_logits: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """The decode loop's `next_logits(token [live])`, recording the fed tokens' routes at their column."""
        def recorded(token: Tensor) -> Tensor:
            with self._capture() as taken:
                logits = next_logits(token)
            for layer, (experts,) in enumerate(taken):
                self.routes[self.live, self.column, layer] = experts.to(ROUTE_DTYPE)
            self.column += 1
            return logits
        return recorded

    def drop(self, drop_rows: Optional[Callable[[Tensor], None]]) -> Optional[Callable[[Tensor], None]]:
        """The decode loop's `drop_rows(keep)`, following which output row each cache row is."""
        if drop_rows is None:
            return None

        def dropped(keep: Tensor) -> None:
            self.live = self.live[keep]
            drop_rows(keep)
        return dropped

    def result(self, prompt_mask: Tensor, response_mask: Tensor, steps_run: int) -> Tensor:
        """[rows, T + steps_run, layers, k]: -1 on padding columns (masks [rows, T] and [rows, >= steps_run])."""
        width = prompt_mask.shape[1]
        real = torch.cat([prompt_mask.bool(), response_mask[:, :steps_run].bool()], dim=1).to(self.routes.device)
        routes = self.routes[:, :width + steps_run]
        return routes.masked_fill(~real[:, :, None, None], -1)
