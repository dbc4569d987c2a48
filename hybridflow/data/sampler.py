"""Which training prompts each step rolls out.

By default a step's prompts are a pure function of ``(data.seed, step)``: the
epochs' permutations cut into batches (:func:`iterate_batches`), so a resumed
run recomputes them.

With ``data.skip_uniform_passes = k > 0`` the sampler also skips, on its next
``k`` passes, a prompt whose last group of samples all scored the same (and, with
``data.skip_uniform_min_score``, at least that score: 1.0 skips only solved
prompts). Such a group has no GRPO advantage: late in a run most groups are all
right, and a step spends rollout and update on prompts that teach nothing.
(DAPO's dynamic sampling instead oversamples and drops such groups; online
difficulty filtering keeps prompts of middling pass rate.) The walk over the
epochs' permutations goes on past skipped prompts until the batch is full, so
every step still rolls out ``train_batch_size`` prompts.

With ``refills`` (``algorithm.dynamic_sampling``) a step may draw more than one
batch: :meth:`PromptSampler.more` walks on from where the step's last batch
ended, so every prompt is still drawn once an epoch, in the epoch's order, and
an epoch ends after fewer steps.

The prompts then depend on what the run scored: the sampler's state (where the
walk stands, which prompts skip how many more passes) is saved in each
checkpoint's trainer.json and restored on resume, so a resumed run draws the
same prompts as an uninterrupted one.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from hybridflow.data.dataset import PromptRecord, batches_per_epoch, epoch_order, iterate_batches

__all__ = ["PromptSampler"]


class PromptSampler:
    def __init__(self, dataset: Sequence[PromptRecord], batch_size: int, shuffle: bool, seed: int,
                 skip_uniform_passes: int = 0, refills: bool = False):
        if skip_uniform_passes < 0:
            raise ValueError(f"skip_uniform_passes must be >= 0, got {skip_uniform_passes}")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.skip_passes = skip_uniform_passes
        self.refills = refills  # a step may draw more batches (`more`): the walk, not the step, says where
        self.steps_per_epoch = batches_per_epoch(len(dataset), batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(f"batch_size {batch_size} is larger than the {len(dataset)} prompts")
        self.position = {record.index: i for i, record in enumerate(dataset)}
        # The walk: the next prompt is order[at] of epoch `epoch`; `step` batches were drawn so far.
        self.step, self.epoch, self.at = 0, 0, 0
        self.skips = np.zeros(len(dataset), dtype=np.int64)  # passes each prompt still skips
        self.skipped = 0  # prompts passed over while drawing the last step's batches
        self.drawn = 0  # prompts the last step's batches hold
        self._order = None

    @property
    def adaptive(self) -> bool:
        """Whether the prompts depend on the steps before (skipping or refills): the walk is then state
        a checkpoint keeps."""
        return self.skip_passes > 0 or self.refills

    def batch(self, step: int) -> list[PromptRecord]:
        """The prompts of training step `step` (1-based)."""
        if not self.adaptive:
            epoch, index = divmod(step - 1, self.steps_per_epoch)
            return next(iterate_batches(self.dataset, self.batch_size, self.shuffle, self.seed, epoch,
                                        start_step=index))
        if step != self.step + 1:
            raise ValueError(f"the sampler (data.skip_uniform_passes, algorithm.dynamic_sampling) stands after step "
                             f"{self.step} and cannot draw step {step}'s prompts (they depend on the scores of every "
                             "step before)")
        self.skipped, self.drawn = 0, 0
        out = self._walk()
        self.step = step
        return out

    def more(self, step: int) -> list[PromptRecord]:
        """Another batch of step `step`'s prompts (a refill of `algorithm.dynamic_sampling`), walking on from
        the step's last batch."""
        if not self.refills:
            raise ValueError("a step draws one batch of prompts unless the sampler refills (dynamic sampling)")
        if step != self.step:
            raise ValueError(f"the sampler stands in step {self.step} and cannot refill step {step}")
        return self._walk()

    def _walk(self) -> list[PromptRecord]:
        """The next `batch_size` prompts of the walk over the epochs' orders, passing over skipped ones."""
        out = []
        while len(out) < self.batch_size:
            order = self._epoch_order()
            if self.at == len(order):
                self.epoch, self.at = self.epoch + 1, 0
                continue
            i = int(order[self.at])
            self.at += 1
            if self.skips[i] > 0:
                self.skips[i] -= 1
                self.skipped += 1
            else:
                out.append(self.dataset[i])
        self.drawn += len(out)
        return out

    def _epoch_order(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch))
        return self._order[1]

    def observe(self, indices: Sequence[int], skip: torch.Tensor) -> None:
        """After scoring: rows (their prompts' F.INDEX, and `skip` [rows] bool, the same for the rows of
        one prompt) say which prompts skip their next passes; the others skip none."""
        if not self.skip_passes:
            return
        for index, flag in zip(indices, skip.tolist()):
            self.skips[self.position[index]] = self.skip_passes if flag else 0

    def metrics(self) -> dict[str, float]:
        if not self.adaptive:
            return {}
        return {"data/skipped_fraction": self.skipped / (self.drawn + self.skipped),
                "data/epoch": self.epoch + self.at / len(self.dataset)}

    # -- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready; empty when the order is a function of the step alone."""
        if not self.adaptive:
            return {}
        waiting = np.nonzero(self.skips)[0]
        return {"step": self.step, "epoch": self.epoch, "at": self.at,
                "skips": {str(self.dataset[int(i)].index): int(self.skips[i]) for i in waiting}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises KeyError/ValueError when `state` does not fit this dataset (nothing is changed then)."""
        if not self.adaptive:
            return
        step, epoch, at = int(state["step"]), int(state["epoch"]), int(state["at"])
        if step < 0 or epoch < 0 or not 0 <= at <= len(self.dataset):
            raise ValueError(f"step {step}, epoch {epoch}, place {at} is outside {len(self.dataset)} prompts")
        skips = np.zeros_like(self.skips)
        for index, passes in state["skips"].items():
            if int(index) not in self.position:
                raise KeyError(f"prompt index {index} is not among the training prompts")
            skips[self.position[int(index)]] = int(passes)
        self.step, self.epoch, self.at, self.skips = step, epoch, at, skips

    def start_after(self, step: int) -> None:
        """Continue after `step` where the fixed order would stand, with nothing skipped (a checkpoint
        saved without this sampler's state)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        self.step, self.epoch, self.at = step, epoch, index * self.batch_size
        self.skips[:] = 0
