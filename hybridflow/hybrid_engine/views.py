"""Generation models whose parameters are views of a training engine's parameters."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridflow.models.decoder import Decoder, rope_inv_freq


def bind_parameters(model: nn.Module, tensors: dict[str, Tensor]) -> nn.Module:
    """Make each named parameter of `model` *be* the given tensor (shared storage, no copy).

    Names and shapes must match exactly; the parameters are frozen (generation
    never back-propagates).
    """
    own = dict(model.named_parameters())
    missing, unexpected = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())
    if missing or unexpected:
        raise KeyError(f"cannot bind weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, tensor in tensors.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: generation shape {tuple(own[name].shape)} != "
                             f"training shape {tuple(tensor.shape)}")
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._parameters[leaf] = nn.Parameter(tensor.detach(), requires_grad=False)
    return model


def generation_model(engine) -> Decoder:
    """A `Decoder` over views of `engine`'s parameters (tp = pp = 1)."""
    views = engine.generation_state()
    with torch.device("meta"):
        model = Decoder(engine.cfg)
    bind_parameters(model, views)
    device = next(iter(views.values())).device
    model.register_buffer("inv_freq", rope_inv_freq(engine.cfg).to(device), persistent=False)
    return model.eval()
