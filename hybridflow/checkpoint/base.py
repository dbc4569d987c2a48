"""The base model a LoRA checkpoint's adapters were trained on, recorded at each save and checked on resume.

A LoRA shard holds the adapters alone and a resume reads the base again from `model.path`, so adapters resumed
onto another base would train on silently. trainer.json's `base` records the path and a fingerprint of the
base's content: the sha256 of every tensor's name, shape and first row (as float32), read from the safetensors
files in name order. It is independent of the path, of how the weights are split into files and of an exact
upcast (bf16 -> fp32), and any fine-tune of the weights changes it; it reads one row per tensor (kilobytes of a
multi-gigabyte model). A resume refuses a base whose fingerprint differs; the same model at another path passes.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

from hybridflow.errors import ConfigError

KEY = "base"  # trainer.json's entry: {"path": ..., "sha256": ...}


def fingerprint(path: str) -> str:
    """sha256 over the safetensors tensors at `path`: each one's name, shape and first row in float32."""
    from hybridflow.models.checkpoint import SafetensorsReader

    digest = hashlib.sha256()
    with SafetensorsReader(path) as reader:
        for name in sorted(reader.keys()):
            shape = reader.shape(name)
            digest.update(f"{name}{list(shape)}".encode())
            if not shape or shape[0] == 0:
                continue
            row = reader(name, rows=slice(0, 1)) if len(shape) > 1 else reader(name)
            digest.update(row.to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def base_record(path: str) -> dict[str, str]:
    """trainer.json's `base` for adapters trained on the model at `path`."""
    return {"path": str(path), "sha256": fingerprint(path)}


def check_base(saved: Any, here: dict[str, str], directory: str) -> None:
    """Refuse (ConfigError on `model.path`, naming both paths) to resume adapters saved on the base `saved`
    (trainer.json's `base`; None for a step that recorded none) onto the base `here` when their contents
    differ."""
    if not isinstance(saved, dict) or saved.get("sha256") == here["sha256"]:
        return
    same_path = str(saved.get("path")) == here["path"]
    what = ("its files changed since then" if same_path else f"{here['path']!r} is another model")
    raise ConfigError("model.path", f"{here['path']!r}: the LoRA adapters in {directory} were trained on the base "
                      f"model {saved.get('path')!r} (sha256 {str(saved.get('sha256'))[:12]}) and {what} (sha256 "
                      f"{here['sha256'][:12]}); resume with model.path={saved.get('path')!r}, or start over with "
                      "trainer.resume=disable trainer.overwrite=true")


def lora_base(rank: int, path: str) -> Optional[dict[str, str]]:
    """`base_record(path)` for an actor with adapters (`rank` > 0), else None (a full model is checked by
    its tensor table alone)."""
    return base_record(path) if rank > 0 else None
