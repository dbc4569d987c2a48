"""The formats of the reshard tool, one table: `--to` names one, and a SRC is opened by the first that holds it.

- hf (`hf.py`): safetensors, single or sharded with an index
- hybridflow (`hybridflow.py`): a training run's checkpoint, one role at a time, at any TP x PP
- dist (`dist.py`): megatron-core `dist_checkpointing`, what Megatron-LM's GPTModel loads
- fsdp (`fsdp.py`): an FSDP engine's role directory (torch DCP, `engine/fsdp.py`); a trainer's step or root
  holding one is hybridflow's, which opens the role by the format it was saved in

Each module holds its format's reader and writer; `convert.py`, `verify.py` and the command line reach them
only through FORMATS.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from hybridflow.checkpoint.format import ROLES
from hybridflow.errors import ConfigError
from hybridflow.reshard import dist, fsdp, hf
from hybridflow.reshard import hybridflow as training_checkpoint  # not to shadow the package's name here
from hybridflow.reshard.base import Format, Source

FORMATS: dict[str, Format] = {f.name: f for f in (hf.FORMAT, training_checkpoint.FORMAT, dist.FORMAT,
                                                   fsdp.FORMAT)}


def open_source(path: str | Path, role: str = "actor", config: Optional[str | Path] = None) -> Source:
    """The checkpoint at `path`, its format found from its files. `config`: the model's config.json (or its
    directory) where the checkpoint has none beside it (a training run's checkpoints)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"SRC: no checkpoint directory at {path}")
    if role not in ROLES:
        raise ConfigError("--role", f"{role!r} is not one of {ROLES}")
    # A directory of no format: the hybridflow reader's error says what it looked for.
    found = next((f for f in FORMATS.values() if f.holds(path)), FORMATS["hybridflow"])
    return found.source(path, role, Path(config) if config else None)
