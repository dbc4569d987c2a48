"""Routing replay and the route mismatch in megatron-core's routers: the trainer routes each token to the experts
the rollout (or the old-log-prob pass) chose, and counts where its own choice differs.

Sampler and trainer compute a router's logits with other kernels, precisions and batch shapes, so near-ties fall
the other way and some tokens reach other experts: their log-prob ratio measures two different functions, and RL
on MoE models collapses from it (Megatron-LM issue 4168; NeMo-RL's R3, slime, verl replay routes). A batch carries
the rollout's routes as ROUTES [B, S, layers, k] (int16, -1 where none; `rollout/routes.py`), aligned with its
INPUT_IDS columns. megatron-core's top-k routing asks a `router_replay` object for its indices; `RouteReplay` puts
one on every router, which

- measures: the router's own top-k against ROUTES, per (token, layer) where both exist;
- replays (`target` = ROUTES or OLD_ROUTES): routes by those experts instead, the probabilities gathered from the
  router's scores at them, so the gate weights still get their gradient and the aux loss counts the replayed map;
- records (`record`): keeps the router's own choice, the OLD_ROUTES an update then replays.

Which token the router sees at which row of its [s * b] input depends on the layout (left alignment, packing,
shared prompts, CP chunks, SP slices): the engine hands `begin` the micro-batch's token tags, the batch position
(row * S + column) + 1 of every column of the model's input ids (0: a column the layout added), transformed as the
ids were; this module takes the rank's SP slice of them and the router's [s, b] order.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.data import fields as F
from hybridflow.engine.distributed import all_reduced

__all__ = ["RouteReplay", "input_tags"]


class _Router:
    """megatron-core's `router_replay` for one layer: its `get_replay_topk` is called with the router's scores."""

    def __init__(self, owner: "RouteReplay", layer: int):
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None):
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        step = self.owner.current
        return own if step is None else step.route(self.layer, scores, *own)


class _MicroBatch:
    """One micro-batch's routes on this rank: what it measures, replays and records, in batch coordinates."""

    def __init__(self, tokens: Tensor, rows: int, width: int, layers: int, k: int, sampler: Optional[Tensor],
                 target: Optional[Tensor], record: bool):
        self.tokens, self.rows, self.width = tokens, rows, width  # tokens [s * b]: batch position or -1
        flat = lambda t: None if t is None else t.reshape(-1, *t.shape[2:]).to(tokens.device)
        self.sampler, self.target = flat(sampler), flat(target)
        n = max(rows * width, 1)
        # int32: what gloo reduces (no int16); routes leave as int16.
        self.mismatch = torch.zeros(n, dtype=torch.int32, device=tokens.device)  # layers routed otherwise
        self.measured = (torch.zeros(rows, width, dtype=torch.bool) if sampler is None  # [rows, S]: both routed
                         else (sampler[..., 0, 0] >= 0).cpu())
        self.recorded = torch.full((n, layers, k), -1, dtype=torch.int32, device=tokens.device) if record else None

    def route(self, layer: int, scores: Tensor, probs: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        if self.tokens.device != idx.device:  # where the model runs (the batch arrives on the CPU)
            for name in ("tokens", "sampler", "target", "mismatch", "recorded"):
                value = getattr(self, name)
                setattr(self, name, None if value is None else value.to(idx.device))
        real = self.tokens >= 0
        at = self.tokens.clamp(min=0)
        if self.sampler is not None:
            want = self.sampler[at, layer].long()
            both = real & (want >= 0).all(-1)
            differ = both & (idx.sort(-1).values != want.sort(-1).values).any(-1)
            self.mismatch.index_add_(0, at[differ], torch.ones_like(at[differ], dtype=torch.int32))
        if self.recorded is not None:
            self.recorded[at[real], layer] = idx[real].to(torch.int32)
        if self.target is None:
            return probs, idx
        forced = self.target[at, layer].long()
        use = real & (forced >= 0).all(-1)
        idx = torch.where(use[:, None], forced, idx)
        return scores.gather(1, idx), idx


class RouteReplay:
    """Hooks on every router of `chunks` (an MoE model's; a dense one gets none). Per pass the role sets `target`
    (None, F.ROUTES or F.OLD_ROUTES: which batch field to route by) and `record`; the engine calls `begin` before
    each micro-batch's forward on a stage and `end` after it; `collect()` (a collective over the engine's
    model-parallel ranks) then gives each micro-batch's figures in batch coordinates."""

    def __init__(self, chunks: list[nn.Module], num_layers: int, top_k: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.layers, self.k = num_layers, top_k
        self.active = False
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.router_replay = _Router(self, module.layer_number - 1)
                    self.active = True
        self.target: Optional[str] = None
        self.record = False
        self.current: Optional[_MicroBatch] = None
        self._steps: dict[int, _MicroBatch] = {}  # by id of the micro-batch dict, in the order first seen

    def begin(self, batch: dict[str, Any], rows: int, tags: Callable[[], Tensor], sequence_split: int) -> None:
        """Before the forward of `batch` (its first `rows` rows real) on this stage: tags() gives [b, w], the
        model's input columns' batch positions + 1 (module doc; computed only when routes are measured,
        replayed or recorded, not for a dense model's every micro-batch); sequence_split: tp under sequence
        parallelism (each TP rank's routers see its slice of the columns), else 1."""
        sampler, target = batch.get(F.ROUTES), batch.get(self.target) if self.target else None
        if not self.active or (sampler is None and target is None and not self.record):
            self.current = None
            return
        if self.target and target is None:
            raise KeyError(f"routing replay routes by {self.target!r}, which the micro-batch does not hold")
        tags = tags()
        if sequence_split > 1:
            from megatron.core import parallel_state as ps
            tags = tags.chunk(sequence_split, dim=1)[ps.get_tensor_model_parallel_rank()]
        tokens = tags.t().reshape(-1).long() - 1  # the router's [s, b] order
        width = batch[F.INPUT_IDS].shape[1]
        tokens = tokens.masked_fill(tokens >= rows * width, -1)  # rows a pipeline added to give one shape
        step = self._steps.get(id(batch))
        if step is None:  # a micro-batch's first chunk (virtual pp: later chunks hold other layers of it)
            step = self._steps[id(batch)] = _MicroBatch(tokens, rows, width, self.layers, self.k,
                                                        sliced(sampler, rows), sliced(target, rows), self.record)
        step.tokens = tokens
        self.current = step

    def end(self) -> None:
        self.current = None

    def reset(self) -> None:
        """Forget what an earlier pass left uncollected (the engine calls it as a pass starts)."""
        self._steps.clear()

    def collect(self) -> list[dict[str, Tensor]]:
        """Per micro-batch since the last pass began: {F.ROUTE_MISMATCH: [rows, S] float32, the share of layers
        where the trainer's experts differed from ROUTES, -1 where ROUTES has none; F.OLD_ROUTES:
        [rows, S, layers, k] when recording}, agreed over the ranks holding parts of the model (TP and CP ranks
        hold other tokens or the same ones, PP ranks other layers): a collective over them."""
        from megatron.core import parallel_state as ps

        tp_cp, pp = ps.get_tensor_and_context_parallel_group(), ps.get_pipeline_model_parallel_group()
        out = []
        for step in self._steps.values():
            shape = (step.rows, step.width)
            mismatch = all_reduced(all_reduced(step.mismatch, tp_cp, dist.ReduceOp.MAX), pp, dist.ReduceOp.SUM)
            mismatch = mismatch[:step.rows * step.width].view(shape).cpu().float() / self.layers
            got = {F.ROUTE_MISMATCH: mismatch.masked_fill(~step.measured, -1.0)}
            if step.recorded is not None:
                recorded = all_reduced(all_reduced(step.recorded, tp_cp, dist.ReduceOp.MAX), pp, dist.ReduceOp.MAX)
                got[F.OLD_ROUTES] = recorded[:step.rows * step.width].view(*shape, self.layers, self.k).cpu().short()
            out.append(got)
        self._steps.clear()
        return out


def input_tags(batch: dict[str, Any], idx: Tensor, multiple: int = 1, lengths: Optional[Tensor] = None,
               shared: Optional[tuple[Tensor, int, int]] = None, cp: Optional[tuple[int, int, int]] = None) -> Tensor:
    """The batch position + 1 of each column of the model's input ids, made from `batch` as the engine makes
    them: left-aligned by `idx`; then packed into one row (`lengths`: each row's real tokens), or shared-prompt
    rows (`shared`: the index `share_prompt_rows` gave, and its rows and width), or CP rank `cp[1]`'s chunks of
    rows `cp[2]` wide (`cp[0]` ranks); padded on the right to a multiple of `multiple`. 0: no batch token."""
    from hybridflow.engine.packing import padded_width
    from hybridflow.parallel.cp_split import cp_split

    b, width = batch[F.INPUT_IDS].shape
    tags = (torch.arange(b)[:, None] * width + torch.arange(width)[None] + 1) * batch[F.ATTENTION_MASK].cpu().bool()
    tags = tags.gather(1, idx.cpu())
    if lengths is not None:
        tags = tags[torch.arange(width)[None] < lengths.cpu()[:, None]][None]
    elif shared is not None:
        index, rows, columns = shared
        index = index.cpu()
        flat = torch.zeros(rows * columns, dtype=tags.dtype)
        flat[index[index >= 0]] = tags[index >= 0]  # a shared prompt's columns: its first row's positions
        tags = flat.view(rows, columns)
    if cp is not None:
        ranks, rank, columns = cp
        tags = torch.nn.functional.pad(tags, (0, columns - tags.shape[1]))
        return cp_split(tags, ranks, rank)[0]
    return torch.nn.functional.pad(tags, (0, padded_width(tags.shape[1], multiple) - tags.shape[1]))


def sliced(t: Optional[Tensor], rows: int) -> Optional[Tensor]:
    return None if t is None else t[:rows]
