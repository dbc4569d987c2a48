"""The hybridflow checkpoint format: what a step directory holds, named and checked in one place.

    root/latest                          "step_000010": the current step (`manager.py` writes it)
    root/step_000010/manifest.json       every file of the step, its size and (small files) its sha256
    root/step_000010/trainer.json        TRAINER_STATE: step, kl_coef, [sampler], models, layouts, [base]
    root/step_000010/actor/engine_tp{t}_pp{p}_dp{d}.pt   one rank's shard (`shard_file`; `_cp{c}` at CP rank c > 0);
                                                   critic/ alike

trainer.json's `models` is each checkpointed model's tensor table (`model_table`: Megatron name -> full
shape, the vocabulary padded as at TP 1, a critic's output layer its one-value head) and `layouts` the layout
its shards were written at ("p1-t2-d1"): the trainer writes them at each save, the reshard tool for the
layout it writes, and a resume compares both with its own run (`check_models`, `check_layouts`) before any
shard is read. The engine writes and reads the shards, the trainer trainer.json, the reshard tool both; none
of them spells a name or a key of the format itself. The atomic writes are `hybridflow.common`'s.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional

from hybridflow.checkpoint.base import KEY as BASE
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import foreign_shapes
from hybridflow.models.config import DecoderConfig

ROLES = ("actor", "critic")  # the checkpointed models: one directory each in a step
TRAINER_STATE = "trainer.json"
LATEST = "latest"
MANIFEST = "manifest.json"
VALUE_HEAD = "score.weight"  # the critic's value head in HF form (a one-label token classifier)
OUTPUT_LAYER = "output_layer.weight"  # its Megatron name: the critic's output layer is the value head
STEP_DIR = re.compile(r"^step_(\d+)$")
SHARD_FILE = re.compile(r"^engine_tp(\d+)_pp(\d+)_dp(\d+)(?:_cp(\d+))?\.pt$")
# An FSDP engine's role directory is a torch DCP checkpoint (`.metadata`, `__R_0.distcp`) with this file beside
# it: {"engine": "fsdp", "world", "value_head", "optimizer", "scheduler"} (engine/fsdp.py writes it).
FSDP_STATE = "engine.json"


class CheckpointError(OSError):
    """A checkpoint step could not be saved (earlier checkpoints are untouched), or not resumed from.

    One for a full disk carries errno ENOSPC and the step directory as its filename, as an OSError would, so
    whoever reports full disks (the CLI) names it; its text is then "<what happened>: <directory>".
    """

    def __init__(self, step: int, message: str, code: Optional[int] = None, path: Optional[Path] = None):
        self.step = step
        if code is None:
            super().__init__(message)
        else:
            super().__init__(code, message, str(path))

    def __str__(self) -> str:
        return super().__str__() if self.errno is None else f"{self.strerror}: {self.filename}"


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def shard_file(tp_rank: int, pp_rank: int, dp_rank: int = 0, cp_rank: int = 0) -> str:
    """The file name of one rank's shard in a role directory. A context-parallel rank other than 0 has its own
    (`_cp{c}`): CP ranks hold other experts at parallel.ep > 1 and other optimizer shards under the distributed
    optimizer, which megatron-core spreads over the data- and context-parallel ranks."""
    return f"engine_tp{tp_rank}_pp{pp_rank}_dp{dp_rank}" + (f"_cp{cp_rank}" if cp_rank else "") + ".pt"


def shard_coordinates(name: str) -> Optional[tuple[int, int, int, int]]:
    """(tp, pp, dp, cp) of a shard file's name, or None for another file."""
    match = SHARD_FILE.match(name)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]), int(match[4] or 0))


# --- trainer.json ----------------------------------------------------------------

def model_table(decoder: DecoderConfig, divisible_by: int, value_head: bool) -> dict[str, list[int]]:
    """{Megatron parameter: full shape} of a model, from the bridge (the vocabulary padded as at TP 1, so the
    table describes the model, not the layout); a critic's output layer is its one-value head."""
    if not decoder.native:  # a model only transformers builds: its own parameters, by HF name
        shapes = foreign_shapes(decoder, value_head)
    else:
        shapes = get_bridge(decoder, divisible_by, 1).megatron_shapes()
    if value_head:
        shapes[OUTPUT_LAYER] = (1, decoder.hidden_size)
    return {name: list(shape) for name, shape in shapes.items()}


def trainer_state(step: int, models: dict[str, dict[str, list[int]]], layouts: dict[str, str],
                  kl_coef: Optional[float] = None, sampler: Optional[dict] = None,
                  base: Optional[dict] = None) -> dict[str, Any]:
    """A step's trainer.json. `kl_coef` None: a step made from an HF model (`hybridflow reshard`, step 0),
    which a run starts with its config's KL coefficient; `sampler`: the prompt sampler's state, where it has
    one (data.skip_uniform_passes); `base`: the base model of a LoRA actor's adapters (`base.base_record`)."""
    state: dict[str, Any] = {"step": step}
    if kl_coef is not None:
        state["kl_coef"] = kl_coef
    state.update(models=models, layouts=layouts)
    if sampler is not None:
        state["sampler"] = sampler
    if base is not None:
        state[BASE] = base
    return state


def read_trainer_state(directory: Path, step: int) -> dict[str, Any]:
    """A checkpoint's trainer.json for a resume, or a CheckpointError naming it (a step saved before manifests
    recorded digests is not checked by its manifest)."""
    path = directory / TRAINER_STATE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        # Step 0 from `hybridflow reshard` (an HF model at a layout) has no KL coefficient yet: the config's.
        if ("kl_coef" in state or state.get("step") != 0) and not math.isfinite(float(state["kl_coef"])):
            raise ValueError("no finite kl_coef")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(step, f"trainer.resume=auto: {path} is not a trainer state this run can resume "
                                    f"from ({type(exc).__name__}: {exc}); move the step away to resume from an "
                                    "earlier one, or start over with trainer.resume=disable trainer.overwrite=true"
                              ) from None
    return state


# --- the checks of a resume ---------------------------------------------------------

def _first_difference(saved: dict[str, list[int]], here: dict[str, list[int]]) -> Optional[str]:
    """The first tensor, in the checkpoint's order, that is missing on one side or shaped otherwise."""
    for name, shape in saved.items():
        if name not in here:
            return f"{name} {list(shape)} is in the checkpoint and not in this model"
        if list(here[name]) != list(shape):
            return f"{name} is {list(shape)} in the checkpoint and {list(here[name])} in this model"
    extra = next((name for name in here if name not in saved), None)
    return None if extra is None else f"{extra} {list(here[extra])} is in this model and not in the checkpoint"


def check_layouts(saved: Any, here: dict[str, str], directory: Path, step: int) -> None:
    """Refuse to resume from `directory` when its shards were written at another layout (`saved`, checkpoint
    name -> "p1-t2-d1"; None for a step saved before layouts were recorded): each rank reads the shard of its
    own coordinates, so a run resumes at the layout it saved at."""
    if not isinstance(saved, dict):
        return
    for name, layout in here.items():
        if name in saved and saved[name] != layout:
            role = "actor" if name == "actor" else "critic"
            how = (f"{role}.engine, trainer.n_devices, placement" if "fsdp" in (saved[name] + layout)
                   else f"{role}.parallel, trainer.n_devices, placement")
            raise CheckpointError(step, f"trainer.resume=auto: {directory}: its {name} was saved at layout "
                                        f"{saved[name]} (its shards per rank) and this run trains it at {layout}; "
                                        f"resume at the saved layout ({how})")


def check_models(saved: Any, here: dict[str, dict[str, list[int]]], directory: Path, step: int,
                 paths: dict[str, str]) -> None:
    """Refuse to resume from `directory` when the models it was saved from (`saved`, checkpoint name ->
    {tensor: shape}, as recorded at save time; None for a step saved before they were recorded) differ from
    this run's (`here`): a CheckpointError naming the step, the model (`paths`) and the first tensor that
    differs, instead of a KeyError from deep inside a worker's load."""
    if saved is None:
        return
    how = "resume with the model it was saved with, or start over with trainer.resume=disable trainer.overwrite=true"
    if not (isinstance(saved, dict) and all(isinstance(t, dict) for t in saved.values())):
        raise CheckpointError(step, f"trainer.resume=auto: {directory}/{TRAINER_STATE}: its 'models' entry is not "
                                    "a table of tensor shapes; move the step away to resume from an earlier one")
    for name, tensors in here.items():
        if name not in saved:
            raise CheckpointError(step, f"trainer.resume=auto: {directory} holds no {name} (its run had none) and "
                                        f"this run trains one; {how}")
        diff = _first_difference(saved[name], tensors)
        if diff is not None:
            raise CheckpointError(step, f"trainer.resume=auto: {directory}: its {name} does not fit this run's "
                                        f"model {paths[name]}: {diff}; {how}")


def optimizer_param_state(opt) -> Optional[dict]:
    """A megatron-core distributed optimizer's own shard of Adam state, in the form its loader reads back
    (None for a plain optimizer, whose state is in its `state_dict`)."""
    if not hasattr(opt, "get_parameter_state_dp_reshardable"):
        return None
    state = opt.get_parameter_state_dp_reshardable()
    for gbuf_idx, by_dtype in state.items():
        if isinstance(gbuf_idx, int):
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for elem in bucket:
                        elem.setdefault("padding", False)  # the loader filters on this key
    return state
