"""DAPO's driver-side pieces (Yu et al. 2025, arXiv 2503.14476), each chosen once when the trainer is built.

    collect(step, first)   # dynamic sampling: generate more batches of prompts until the step holds
                           #   data.train_batch_size groups whose scores differ (`DynamicSampling`)
    [overlong shaping]     # before the token stage: the soft length penalty added to each score
    token stage            # (the trainer's): scores on the last token, advantages
    [drop truncated rows]  # after it: responses the limit cut leave the update (algorithm.mask_truncated)

Clip-higher (actor.clip_ratio_high) and the token-mean loss are the actor's settings already. Everything here
reads one number a row (scores, lengths, group ids, the TRUNCATED flag) and cuts rows, so it runs on the driver
under Ray as in one process (`workers/driver_rows.py`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from hybridflow.algos.overlong import overlong_penalty
from hybridflow.common import mix_seed
from hybridflow.config.schema import Config
from hybridflow.data import fields as F
from hybridflow.data.batch import concat, take_rows
from hybridflow.trainer import rl_steps as S
from hybridflow.workers.driver_rows import DriverBatch, off_driver

Batch = dict[str, Any]
Metrics = dict[str, float]
Stage = Callable[[Batch, Metrics], Batch]
Generated = tuple[Batch, Any]  # a batch through the flow (as the driver holds it) and the flow's result
log = logging.getLogger(__name__)


class Collected(NamedTuple):
    """One step's rollout as the trainer goes on with it."""

    batch: DriverBatch  # the rows it trains on
    generated: Batch  # what the driver holds of every row it generated (its reward and length figures)
    flow: Any  # the flow's result; with refills, its timings summed over the batches
    metrics: Metrics


def one_batch(step: int, first: Generated) -> Collected:
    """Without dynamic sampling a step trains on the batch it generated."""
    batch, flow = first
    return Collected(batch, batch, flow, {})


def refill_seed(seed: int, step: int, refill: int) -> int:
    """The sampling seed of batch `refill` of `step` (0: the step's own, `mix_seed(seed, step)`). A refill's
    is a 40-bit digest of the three, apart from every step's own seed, so a prompt drawn again has new samples;
    40 bits keep `mix_seed(seed, row)` within int64."""
    if refill == 0:
        return mix_seed(seed, step)
    digest = hashlib.blake2b(f"{seed}/{step}/{refill}".encode(), digest_size=5).digest()
    return int.from_bytes(digest, "little")


def driver_fields(batch: Batch) -> Batch:
    """The fields of `batch` the driver holds (one number or item a row), not read through `DriverBatch`."""
    return {k: v for k, v in dict.items(batch) if not off_driver(k, v)}


def group_ordinals(uids: list) -> Tensor:
    """Each row's group [B] numbered by first appearance (0, 1, ...)."""
    first: dict = {}
    return torch.tensor([first.setdefault(u, len(first)) for u in uids], dtype=torch.long)


def group_count(batch: Batch) -> int:
    return len(set(batch[F.UID]))


class DynamicSampling:
    """DAPO's dynamic sampling with refill.

    groups: the groups a step trains on (data.train_batch_size); max_batches: the most batches a step
    generates; refill(step, k) -> batch k of the step (k >= 1) through the flow; informative(batch) -> the
    rows [B] bool of groups with a signal; observe(batch): what else must see every generated row (the
    prompt sampler's note of uniform groups, data.skip_uniform_passes).
    """

    def __init__(self, groups: int, max_batches: int, refill: Callable[[int, int], Generated],
                 informative: Callable[[Batch], Tensor], observe: Optional[Callable[[Batch], None]] = None):
        if groups < 1 or max_batches < 1:
            raise ValueError(f"dynamic sampling needs groups >= 1 and max_batches >= 1, got {groups}, {max_batches}")
        self.groups, self.max_batches = groups, max_batches
        self.refill, self.informative, self.observe = refill, informative, observe

    def __call__(self, step: int, first: Generated) -> Collected:
        kept, generated, flows, found, total, k = [], [], [], 0, 0, 0
        while True:
            batch, flow = first if k == 0 else self.refill(step, k)
            if k:  # a prompt drawn twice in one step makes two groups
                batch[F.UID] = [f"{uid}/{k}" for uid in batch[F.UID]]
            k += 1
            flows.append(flow)
            generated.append(driver_fields(batch))
            if self.observe is not None:
                self.observe(batch)
            total += group_count(batch)
            part = take_rows(batch, self.informative(batch))
            kept.append(part)
            found += group_count(part)
            if found >= self.groups or k == self.max_batches:
                break
        batch = concat(kept) if len(kept) > 1 else kept[0]
        batch = take_rows(batch, group_ordinals(batch[F.UID]) < self.groups)  # the last batch's extra groups
        held = min(found, self.groups)
        if held < self.groups:
            log.warning("step %d: dynamic sampling generated %d batches (algorithm.dynamic_sampling.max_batches) "
                        "and found %d of %d groups whose scores differ; %s", step, k, held, self.groups,
                        "training on those" if held else "the step takes no update")
        metrics = {"dapo/kept_groups": float(held), "dapo/generated_batches": float(k),
                   "dapo/informative_fraction": found / total, "dapo/filled": float(held == self.groups)}
        every = concat(generated) if len(generated) > 1 else generated[0]
        return Collected(DriverBatch(batch), every, summed(flows), metrics)


def summed(flows: list) -> Any:
    """One flow result for a step that ran the flow several times: the first, its timings summed over all."""
    if len(flows) == 1:
        return flows[0]
    timings: dict[str, float] = {}
    for flow in flows:
        for name, seconds in flow.timings.items():
            timings[name] = timings.get(name, 0.0) + seconds
    return dataclasses.replace(flows[0], timings=timings, wall_s=sum(f.wall_s for f in flows),
                               overlap_s=sum(f.overlap_s for f in flows))


class OverlongShaping:
    """The soft overlong punishment (`algos.overlong_penalty`) added to each row's score (SCORES and the
    OUTCOME_SCORES the token stage places on the last token), after the rollout figures and the group filter
    read the unshaped score; `dapo/overlong_penalty` (its mean) and `dapo/overlong_fraction` (rows it lowers)."""

    def __init__(self, max_length: int, buffer: int, penalty: float):
        self.max_length, self.buffer, self.penalty = max_length, buffer, penalty

    def __call__(self, batch: Batch, metrics: Metrics) -> Batch:
        pen = overlong_penalty(batch[F.RESPONSE_LENGTH], self.max_length, self.buffer, self.penalty)
        batch[F.OUTCOME_SCORES] = batch[F.OUTCOME_SCORES] + pen
        batch[F.SCORES] = batch[F.SCORES] + pen
        if len(pen):
            metrics["dapo/overlong_penalty"] = pen.mean().item()
            metrics["dapo/overlong_fraction"] = (pen < 0).float().mean().item()
        return batch


def drop_truncated(batch: Batch, metrics: Metrics) -> Batch:
    """Overlong filtering: the rows the length limit cut leave the update, after the token stage computed
    every row's advantage (a cut row still counts in its group's mean and std, as the paper masks only its
    loss). Leaving a row out is zeroing its response mask for every loss term: it adds nothing to a loss's
    numerator nor to its count, so the token-mean divides by the kept rows' tokens only. That is the choice:
    counting the cut rows' tokens too would shrink every step's gradient by the share of cut tokens, a
    learning rate that changes with the response lengths. `dapo/truncated_fraction`: the rows left out."""
    cut = batch[F.TRUNCATED].bool()
    if len(cut):
        metrics["dapo/truncated_fraction"] = cut.float().mean().item()
    return take_rows(batch, ~cut)


def dapo_stages(cfg: Config, token_stage: Stage) -> list[Stage]:
    """`token_stage` (the advantages) with the whole-batch stages DAPO puts around it: overlong shaping before
    (reward.overlong_buffer), overlong filtering after (algorithm.mask_truncated)."""
    buffer = cfg.reward.overlong_buffer
    before = [OverlongShaping(cfg.data.max_response_length, buffer.length, buffer.penalty)] if buffer.length else []
    return [*before, token_stage, *([drop_truncated] if cfg.algorithm.mask_truncated else [])]


def step_collector(cfg: Config, sampler, refill: Callable[[int, int], Generated],
                   baseline: bool) -> Callable[[int, Generated], Collected]:
    """How a step collects its rows: `one_batch`, or dynamic sampling (algorithm.dynamic_sampling). A group
    has a signal where its scores differ; for ReMax (`baseline`) where a sample scored other than the
    greedy response."""
    ds = cfg.algorithm.dynamic_sampling
    if not ds.enabled:
        return one_batch
    informative = S.rows_off_baseline if baseline else S.nonuniform_rows
    observe = None
    if sampler.skip_passes:
        floor = cfg.data.skip_uniform_min_score
        observe = lambda batch: sampler.observe(batch[F.INDEX], S.uniform_rows(batch, floor))  # noqa: E731
    return DynamicSampling(cfg.data.train_batch_size, ds.max_batches, refill, informative, observe)
