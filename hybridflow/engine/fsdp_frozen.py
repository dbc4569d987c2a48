"""Frozen Hugging Face models sharded by FSDP2: a reward model (or guard) that costs each rank 1/N of it.

`load_sharded_classifier(path, group_device)` builds the `transformers`
sequence classifier at `path` on the meta device (no memory), `fully_shard`s
it (`shard_frozen`: the input embedding, each decoder layer's linear layers and the layer, then the root)
over a one-dimensional device mesh of the world, allocates only this rank's
dim-0 chunk of every parameter, and reads exactly those rows from the
safetensors files (`models.checkpoint.SafetensorsReader`): no rank ever holds
the whole model, nor one whole tensor of it. A rank's peak while scoring is
its shard plus the largest unit gathered (the embedding or a linear layer),
once (`engine/fsdp_comm.py`), plus activations (`hybridflow bench fsdp` measures it).

Every forward all-gathers each unit's weights over the mesh, so every rank
must run the same number of forward passes: `FSDPRewardModel.score` agrees
the largest micro-batch count over the mesh (all_reduce MAX) and a rank with
fewer (none included) runs idle one-token passes after its own.

Simplified: one mesh dimension (pure sharding, no replication); the model's
own dtype (no mixed-precision policy); non-persistent buffers other than the
usual rotary embeddings' are refused rather than guessed.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.engine.fsdp import agreed_count, block_units, world_mesh
from hybridflow.engine.fsdp_comm import chunk_bounds
from hybridflow.engine.fsdp_comm import gather_in_place
from hybridflow.engine.fsdp_lora import adapter_param, base_name, base_named
from hybridflow.models.checkpoint import is_rotary, loose_buffers
from hybridflow.models.hf import RewardModel

__all__ = ["FSDPRewardModel", "frozen_units", "load_sharded_classifier", "shard_frozen",
           "world_mesh"]


def frozen_units(model: nn.Module) -> list[nn.Module]:
    """The submodules sharded as units of their own, in forward order, children first: the input embedding,
    then each decoder layer's linear layers and the layer itself (its norms), of an HF model
    (`model.<base>.embed_tokens`, `model.<base>.layers`). The rest (final norm, score head) stays with the
    root unit. Linear layers rather than whole layers: a unit is gathered whole while it runs, so the largest
    one (here the embedding) bounds what the model holds above its shard."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.<base_model_prefix>.layers to shard")
    embedding = getattr(base, "embed_tokens", None)
    units = [embedding] if embedding is not None else []
    for layer in layers:
        units += block_units(layer)
    return units


def shard_frozen(model: nn.Module, mesh) -> nn.Module:
    """`fully_shard` each of `frozen_units(model)`, then the root, over `mesh`; frozen (no gradients, eval).

    A unit's weights are gathered just before its forward and freed after it (reshard_after_forward), so at
    most one unit is whole at a time, and only once (`fsdp_comm.InPlaceAllGather`)."""
    from torch.distributed.fsdp import fully_shard

    model.requires_grad_(False)
    units = frozen_units(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    # The root too: left to itself FSDP keeps the root's weights whole after a forward, for the backward a
    # frozen model never runs.
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    gather_in_place([*units, model], mesh)
    return model.eval()


def init_buffers(model: nn.Module) -> None:
    """Non-persistent buffers are not in the checkpoint and `to_empty` left them uninitialised: the rotary
    embeddings' are recomputed by transformers' own initialiser; any other is refused."""
    for module in model.modules():
        if is_rotary(module):
            model._init_weights(module)
    loose = loose_buffers(model)
    if loose:
        raise NotImplementedError(f"{type(model).__name__}: cannot initialise the non-persistent buffer(s) "
                                  f"{loose} of a model built on the meta device")


def load_shards(model: nn.Module, path: str | Path) -> int:
    """Copy this rank's rows of every parameter (and persistent buffer) of the sharded `model` from the HF
    safetensors at `path`, reading only those rows. Returns the bytes read."""
    from hybridflow.models.checkpoint import SafetensorsReader

    with SafetensorsReader(path) as read:
        load_rows(model, read, f"the checkpoint at {path}")
    return read.bytes_read


@torch.no_grad()
def load_rows(model: nn.Module, read, source: str, prefix: str = "", unused: frozenset[str] = frozenset()) -> None:
    """`load_shards` from `read` (a `models.bridge.SliceReader`: files or a dict in memory; `source` names it
    in errors). The stored name of `model`'s tensor `n` is prefix + n (a base model inside a checkpoint of
    its *ForCausalLM); stored tensors in `unused` (the output layer a value model has not) are not read."""
    stored = set(read.keys())
    wanted = {prefix + n: p for n, p in base_named(model)}  # a model with peft adapters: its base tensors
    buffers = {prefix + base_name(k): v for k, v in model.state_dict().items()
               if not adapter_param(k) and prefix + base_name(k) not in wanted}
    missing = sorted(set(wanted) - stored)
    if missing:
        raise KeyError(f"{source} has no tensor(s) {missing[:5]} of {type(model).__name__}")
    unknown = sorted(n for n in stored - set(wanted) - set(buffers) - unused
                     if not n.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise KeyError(f"{source} holds tensor(s) {unknown[:5]} that {type(model).__name__} does not have")
    for name, param in wanted.items():
        start, stop = chunk_bounds(param)
        if stop > start:
            param.to_local().copy_(read(name, rows=slice(start, stop)))
    for name, buffer in buffers.items():
        if name in stored:
            buffer.copy_(read(name))


class FSDPRewardModel(RewardModel):
    """A `RewardModel` whose classifier is FSDP-sharded over `group`: every rank of it must call `score`
    together (with its own pairs, none included), since each forward pass all-gathers."""

    def __init__(self, model: Any, tokenizer: Any, path: Path, device: torch.device, group, bytes_read: int = 0):
        super().__init__(model, tokenizer, path, device)
        self.group = group
        self.bytes_read = bytes_read  # what loading read from the checkpoint: about 1/N of it

    def idle_pass(self) -> None:
        """A one-token forward that takes part in every unit's all-gather; its output is dropped."""
        ids = torch.full((1, 1), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.model(input_ids=ids, attention_mask=torch.ones_like(ids))

    def score(self, pairs: Sequence[tuple[str, str]], batch_size: int = 16) -> list[float]:
        """As `RewardModel.score`, then idle passes up to the largest micro-batch count over the group."""
        pairs = list(pairs)
        passes = math.ceil(len(pairs) / batch_size) if batch_size >= 1 else 0
        total = agreed_count(passes, self.group, self.device)
        out = super().score(pairs, batch_size)
        for _ in range(total - passes):
            self.idle_pass()
        return out

    def local_fraction(self) -> float:
        """The share of the model's parameters this rank holds (about 1/N)."""
        params = list(self.model.parameters())
        return sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params)

    def __repr__(self) -> str:
        return f"FSDPRewardModel({str(self.path)!r}, device={self.device}, ranks={dist.get_world_size(self.group)})"


def load_sharded_classifier(path: str | Path, device: str = "cpu", dtype: Optional[torch.dtype] = None) -> FSDPRewardModel:
    """The `*ForSequenceClassification` checkpoint at `path`, sharded over the world (see the module doc).
    `dtype`: None keeps the stored one."""
    import transformers

    path = Path(path)
    mesh = world_mesh(device)
    config = transformers.AutoConfig.from_pretrained(path)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    with torch.device("meta"):
        model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    shard_frozen(model, mesh)
    torch_device = torch.device("cpu") if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    model.to_empty(device=torch_device)
    init_buffers(model)
    bytes_read = load_shards(model, path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return FSDPRewardModel(model, tokenizer, path, torch_device, mesh.get_group(), bytes_read)
