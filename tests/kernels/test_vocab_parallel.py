"""Vocab-parallel log-prob/entropy over 2 gloo ranks equals the full-vocab reference."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.kernels import logprob_entropy_reference, vocab_parallel_logprob_entropy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, vocab: int, scale: float):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(40, vocab, generator=g) * scale
        labels = torch.randint(0, vocab, (40,), generator=g)
        w1, w2 = torch.randn(40, generator=g), torch.randn(40, generator=g)

        full = logits.clone().requires_grad_(True)
        lp_ref, ent_ref = logprob_entropy_reference(full, labels)
        ((lp_ref * w1).sum() + (ent_ref * w2).sum()).backward()

        shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprob_entropy(shard, labels)
        ((lp * w1).sum() + (ent * w2).sum()).backward()

        torch.testing.assert_close(lp, lp_ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent_ref.detach(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(shard.grad, full.grad.chunk(world, dim=-1)[rank], rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned gloo processes per case
@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocab, scale", [(64, 1.0), (1000, 20.0)])
def test_vocab_parallel_matches_reference(vocab, scale):
    mp.spawn(_worker, args=(2, _free_port(), vocab, scale), nprocs=2, join=True)
