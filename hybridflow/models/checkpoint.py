"""HF-format checkpoints: safetensors files, single or sharded with an index.

Reading accepts `model.safetensors` or `model.safetensors.index.json` (any
shard names the index lists). Writing is atomic: everything goes into a
temporary sibling directory that is renamed over the target only once
complete, so a crash or a full disk never leaves a half-written checkpoint
where a good one was.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hybridflow.models.bridge import get_bridge
from hybridflow.models.config import DecoderConfig, ModelConfigError
from hybridflow.models.decoder import Decoder, rope_inv_freq
from hybridflow.common import write_dir_atomically

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _weight_files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            names = sorted({str(name) for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONDecodeError is a ValueError
            raise ModelConfigError(f"{path / INDEX_FILE} is not a safetensors index ({type(exc).__name__}: "
                                   f"{exc})") from None
        files = [path / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path / INDEX_FILE} lists shard(s) that do not exist: {missing}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    hint = " (only PyTorch .bin weights found: convert them to safetensors)" if any(
        path.glob("*.bin")) else ""
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}{hint}")


def check_hf_checkpoint(path: str | Path, cfg: DecoderConfig) -> None:
    """ModelConfigError unless the safetensors at `path` hold the tensors that `cfg` (its config.json)
    describes, in their shapes. Reads the files' headers only, no weights: a vocab_size that disagrees
    with the embedding's rows would otherwise be zero-padded on load and exported at the wrong size."""
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for file in _weight_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes.update({name: (tuple(f.get_slice(name).get_shape()), file) for name in f.keys()})
        except (SafetensorError, OSError) as exc:
            raise ModelConfigError(f"{file} is not a readable safetensors file ({exc})") from None
    config = Path(path) / "config.json"
    if not cfg.native:  # the names and shapes of the transformers model config.json builds
        model = foreign_model(cfg)
        loose = loose_buffers(model)
        if loose:
            raise ModelConfigError(f"{cfg.why_foreign}; nor can it run under transformers here: its buffer(s) "
                                   f"{loose[:3]} are in no checkpoint and transformers' initialiser does not "
                                   f"recompute them on a model built on the meta device")
        want = foreign_shapes(cfg, model=model)
        missing, unknown = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want) - {"lm_head.weight"})
        if missing or unknown:
            raise ModelConfigError(f"the weights in {path} do not match {config}: missing {missing[:3]}, "
                                   f"unknown {unknown[:3]}")
        for name, shape in want.items():
            if shapes[name][0] != shape:
                raise ModelConfigError(f"{config} makes {name} {list(shape)}, but {shapes[name][1]} holds "
                                       f"{list(shapes[name][0])}")
        return
    bridge = get_bridge(cfg)
    try:
        bridge.check_hf_names(shapes)
    except KeyError as exc:
        raise ModelConfigError(f"the weights in {path} do not match {config}: {exc.args[0]}") from None
    for name, want in bridge.hf_shapes().items():
        found, file = shapes[name]
        if found == want:
            continue
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and found[1:] == want[1:]:
            raise ModelConfigError(f"{config} says vocab_size {cfg.vocab_size}, but {name} in {file} has "
                                   f"{found[0]} rows")
        raise ModelConfigError(f"{config} makes {name} {list(want)}, but {file} holds {list(found)}")


def foreign_model(cfg: DecoderConfig, value_head: bool = False):
    """The `transformers` model of a foreign description (`DecoderConfig.native` False), on the meta device
    (no memory): its *ForCausalLM, or (value_head) its base model."""
    import transformers

    config = transformers.AutoConfig.for_model(**cfg.hf_config)
    kind = transformers.AutoModel if value_head else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return kind.from_config(config, dtype=torch.float32)


def is_rotary(module) -> bool:
    """A transformers rotary embedding, whose frequency buffers its model's `_init_weights` recomputes."""
    return "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq")


def loose_buffers(model) -> list[str]:
    """The non-persistent buffers of a transformers `model` that no checkpoint holds and nothing recomputes
    (the rotary embeddings' are recomputed: `engine/fsdp_frozen.init_buffers`): on the meta device a model
    cannot be given them."""
    persistent = set(model.state_dict())
    return [f"{module_name}.{n}" for module_name, module in model.named_modules() if not is_rotary(module)
            for n, _ in module.named_buffers(recurse=False) if f"{module_name}.{n}" not in persistent]


def foreign_shapes(cfg: DecoderConfig, value_head: bool = False, model=None) -> dict[str, tuple[int, ...]]:
    """{HF checkpoint name: shape} of a foreign model's parameters (a tied output layer is the embedding;
    a value model's base model under its causal LM's prefix). `model`: its `foreign_model`, when built."""
    model = model if model is not None else foreign_model(cfg, value_head)
    prefix = f"{model.base_model_prefix}." if value_head else ""
    return {prefix + name: tuple(p.shape) for name, p in model.named_parameters()}


def load_hf_state_dict(path: str | Path, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint, optionally cast to `dtype`."""
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if dtype is not None else t
    return out


class TensorsReader:
    """HF tensors already in memory, read by name and slice like a checkpoint (`bridge.SliceReader`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def __call__(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        t = self.tensors[name]
        return t[rows or slice(None)] if cols is None else t[rows or slice(None), cols]


class SafetensorsReader:
    """Slices of the tensors of an HF safetensors checkpoint, read without loading whole tensors.

    `reader(name, rows=slice(a, b))` reads only those rows (`cols` likewise);
    `bytes_read` counts what was read, so a test can check that a rank read
    only its shard. Use as a context manager (it keeps the files open).
    """

    def __init__(self, path: str | Path):
        self.files = _weight_files(Path(path))
        self.bytes_read = 0
        self._open: dict[str, object] = {}
        self._where: dict[str, object] = {}

    def __enter__(self) -> "SafetensorsReader":
        for file in self.files:
            handle = safe_open(str(file), framework="pt").__enter__()
            self._open[str(file)] = handle
            for name in handle.keys():
                self._where[name] = handle
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def keys(self) -> list[str]:
        return list(self._where)

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"HF checkpoint {self.files[0].parent} has no tensor {name!r}")
        return self._where[name].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def __call__(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        part = self._slice(name)
        if rows is None and cols is None:
            t = part[:]
        elif cols is None:
            t = part[rows]
        else:
            t = part[rows or slice(None), cols]
        self.bytes_read += t.numel() * t.element_size()
        return t


def _shards(sd: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    return shards


def _write_weights(sd: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    shards = _shards(sd, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    with open(out / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _write_parts(parts: Iterable[dict[str, torch.Tensor]], count: int, out: Path) -> None:
    """One safetensors file per part, written as each part arrives, and the index."""
    weight_map, total = {}, 0
    for i, part in enumerate(parts, start=1):
        name = f"model-{i:05d}-of-{count:05d}.safetensors"
        save_file({k: t.contiguous() for k, t in part.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    with open(out / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_hf_checkpoint_parts(parts: Iterable[dict[str, torch.Tensor]], count: int, hf_config: dict,
                             path: str | Path, extra_files: tuple[Path, ...] = ()) -> Path:
    """`save_hf_checkpoint` for a model that arrives in `count` parts (e.g. pipeline stages),
    streamed: each part is written when it arrives, so no more than one is held at a time."""
    return _atomic_checkpoint(lambda tmp: _write_parts(parts, count, tmp), hf_config, path, extra_files)


def save_hf_checkpoint(sd: dict[str, torch.Tensor], hf_config: dict, path: str | Path,
                       max_shard_bytes: int = 5 * 2**30, extra_files: tuple[Path, ...] = ()) -> Path:
    """Write config.json + safetensors (sharded past `max_shard_bytes`) atomically.

    `extra_files` (tokenizer files, ...) are copied alongside. An existing
    checkpoint at `path` is replaced only after the new one is complete.
    """
    return _atomic_checkpoint(lambda tmp: _write_weights(sd, tmp, max_shard_bytes), hf_config, path, extra_files)


def _atomic_checkpoint(write_weights, hf_config: dict, path: str | Path, extra_files: tuple[Path, ...]) -> Path:
    def write(tmp: Path) -> None:
        write_weights(tmp)
        with open(tmp / "config.json", "w") as f:
            json.dump(hf_config, f, indent=2)
        for file in extra_files:
            shutil.copy2(file, tmp / Path(file).name)

    return write_dir_atomically(Path(path), write, "save")


def load_decoder(path: str | Path, dtype: str | torch.dtype | None = None) -> Decoder:
    """A `Decoder` with the weights of the HF checkpoint at `path`."""
    cfg = DecoderConfig.from_pretrained(path)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    sd = get_bridge(cfg).hf_to_generation(load_hf_state_dict(path, dtype))
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg)  # non-persistent buffer, still on meta
    return model


def save_decoder(model: Decoder, path: str | Path, **kwargs) -> Path:
    """Export a `Decoder` as an HF checkpoint that `transformers` loads."""
    cfg = model.cfg
    gen = {k: v.detach() for k, v in model.state_dict().items()}
    hf = get_bridge(cfg).generation_to_hf(gen)
    hf_config = cfg.to_hf_dict()
    dtypes = {t.dtype for t in hf.values()}
    hf_config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    return save_hf_checkpoint(hf, hf_config, path, **kwargs)
