"""What the LoRA engine tests share: a tiny model, random (non-zero) adapters, one gradient pass."""
import zlib

import torch

from hybridflow.config.schema import LoRAConfig
from hybridflow.data import fields as F

LORA = LoRAConfig(rank=4, alpha=8.0)


def full_adapters(key: str, rank: int, d_out: int, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rank, d_in] and a non-zero B [d_out, rank] for the adapter `key`, the same in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return 0.3 * torch.randn(rank, d_in, generator=g), 0.3 * torch.randn(d_out, rank, generator=g)


def full_shape(adapted, tp: int) -> tuple[int, int]:
    """(d_out, d_in) of an adapted layer's whole weight, from its local shard at `tp`."""
    d_out, d_in = adapted.module.weight.shape
    return (d_out * tp, d_in) if adapted.column else (d_out, d_in * tp)


def gradient_pass(engine, batch) -> None:
    """One forward and backward of -sum(log-prob * advantage) over the batch; gradients in `main_grad`."""
    from hybridflow.roles.batching import response_log_probs

    def step(output, mb):
        logp, _ = response_log_probs(output, mb, engine, 1.0)
        return -(logp * mb[F.ADVANTAGES]).sum(), {}

    engine.zero_grad()
    engine.run([batch], step)
