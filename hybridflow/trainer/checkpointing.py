"""The trainer's checkpoints: what a step saves and what a resume loads, with the torchrun broadcasts.

A step holds every group's shards (each rank writes its own) and trainer.json
(`hybridflow.checkpoint.format`), published whole by `CheckpointManager`.
Launched by torchrun, every rank runs the trainer: rank 0 owns the checkpoint
root (the temporary directory, the rename, pruning, the choice of the step to
resume from) and broadcasts what the others need, so all ranks write into the
same directory and load the same step, or all raise the same error.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from hybridflow.checkpoint.base import KEY as BASE
from hybridflow.checkpoint.base import check_base
from hybridflow.checkpoint.format import (TRAINER_STATE, CheckpointError, check_layouts, check_models,
                                          read_trainer_state)
from hybridflow.checkpoint.manager import CheckpointManager
from hybridflow.common import atomic_write_json

log = logging.getLogger(__name__)


def write_step(groups: list, directory: Path, state: dict[str, Any]) -> None:
    """Every group's shards (each rank its own), then trainer.json."""
    for group in groups:
        group.save(str(directory))
    atomic_write_json(directory / TRAINER_STATE, state)


def save_step(ckpt: CheckpointManager, step: int, groups: list, state: dict[str, Any], floor: int,
              spmd: bool) -> Path:
    """Save `step` (trainer.json: `state`), refused before writing with less than `floor` bytes free.
    `spmd`: every torchrun rank calls this, and rank 0 tells the others where to write their shards."""
    if not spmd:
        return ckpt.save(step, lambda d: write_step(groups, d, state), floor)
    import torch.distributed as dist

    told = []

    def write(directory: Path) -> None:
        dist.broadcast_object_list([str(directory)], src=0)
        told.append(directory)
        write_step(groups, directory, state)

    if dist.get_rank() == 0:
        try:
            return ckpt.save(step, write, floor)
        except CheckpointError as exc:
            if not told:  # refused before writing (too little free space): the others wait to hear where
                dist.broadcast_object_list([(exc.strerror or str(exc), exc.errno, exc.filename)], src=0)
            raise
    where = [None]
    dist.broadcast_object_list(where, src=0)
    if isinstance(where[0], tuple):
        raise CheckpointError(step, *where[0])
    for group in groups:
        group.save(where[0])
    return Path(where[0])


def resume_point(ckpt: CheckpointManager, spmd: bool) -> Optional[tuple[int, Path]]:
    """The checkpoint to resume from; under torchrun rank 0 decides and tells the others, so every
    rank loads the same step (or all raise the same error)."""
    if not spmd:
        return ckpt.resume_point()
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", ckpt.resume_point())]
        except CheckpointError as exc:
            box = [("error", str(exc))]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(-1, value)
    return value


def resume_state(directory: Path, step: int, models: dict[str, dict[str, list[int]]], layouts: dict[str, str],
                 paths: dict[str, str], base: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The step's trainer.json, once it is read and fits this run (its models' tables and layouts, `paths`
    naming the models, and for a LoRA actor the base model its adapters were trained on, `base`): checked
    before any shard loads, so a bad one fails fast, naming the file."""
    state = read_trainer_state(directory, step)
    check_models(state.get("models"), models, directory, step, paths)
    check_layouts(state.get("layouts"), layouts, directory, step)
    if base is not None:
        check_base(state.get(BASE), base, str(directory))
    return state


def load_latest(ckpt: CheckpointManager, spmd: bool, groups: list, sampler, models: dict[str, dict[str, list[int]]],
                layouts: dict[str, str], paths: dict[str, str],
                base: Optional[dict[str, str]] = None) -> Optional[tuple[int, Path, dict[str, Any]]]:
    """Resume from the newest intact step: (step, directory, its trainer.json) once trainer.json fits this
    run (checked first), the prompt sampler is restored and every group has loaded its shards; None where
    nothing was saved."""
    found = resume_point(ckpt, spmd)
    if found is None:
        return None
    step, directory = found
    state = resume_state(directory, step, models, layouts, paths, base)
    restore_sampler(sampler, state, directory / TRAINER_STATE, step)
    for group in groups:
        group.load(str(directory))
    return step, directory, state


def restore_sampler(sampler, state: dict[str, Any], path: Path, step: int) -> None:
    """The prompt sampler's state from trainer.json (`path`), where it keeps one (data.skip_uniform_passes)."""
    if not sampler.adaptive:
        return
    if "sampler" not in state:  # saved by a run without data.skip_uniform_passes
        log.warning("%s holds no sampler state (saved without data.skip_uniform_passes): the prompts "
                    "continue from step %d's place in the epochs, with no prompt skipped yet", path, step)
        sampler.start_after(step)
        return
    try:
        sampler.load_state_dict(state["sampler"])
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(step, f"{path}: its sampler state does not fit this run's training prompts "
                                    f"({type(exc).__name__}: {exc}); resume with the data it was saved "
                                    "with, or start over with trainer.resume=disable trainer.overwrite=true"
                              ) from None
