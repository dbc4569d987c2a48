"""Advantage scans: GAE and discounted returns as a reverse scan per sequence.

`gae_reference` is the per-timestep loop (vectorised over the batch only);
the `cpu` backend runs the same recursion in C++ (csrc/cpu/kernels.cpp),
one sequence per thread; the `cuda` backend (csrc/cuda/gae.cu) scans each
sequence with one warp, as a parallel scan of affine maps. Masked steps (padding, or tool tokens in the middle
of a response) are skipped: they get 0 and the recursion carries the next
value and advantage across them, as if they were not there.
"""
from __future__ import annotations

import torch

from hybridflow.kernels.backend import cpu_extension, cuda_extension, resolve
from hybridflow.kernels.masked import masked_whiten


def gae_reference(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards, values, mask [B, T] -> (advantages [B, T], returns [B, T]).

    Computed in float64 for float64 rewards, else in float32.
    """
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    rewards, values, mask = rewards.to(dtype), values.to(dtype), mask.bool()
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    next_v = rewards.new_zeros(b)
    next_a = rewards.new_zeros(b)
    for j in range(t - 1, -1, -1):
        m = mask[:, j]
        a = rewards[:, j] + gamma * next_v - values[:, j] + gamma * lam * next_a
        adv[:, j] = torch.where(m, a, 0.0)
        next_v = torch.where(m, values[:, j], next_v)
        next_a = torch.where(m, a, next_a)
    return adv, torch.where(mask, adv + values, 0.0)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
        backend: str = "auto", whiten: bool = False, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on the selected backend; same contract as `gae_reference`.

    whiten: the advantages come back whitened over the batch's valid steps,
    exactly as `masked_whiten` would do it afterwards (returns are not
    whitened); the C++ scan does it in the same call (two more passes over
    the rows), the CUDA and reference backends with masked_whiten.
    The C++ and CUDA scans run in float32; `auto` keeps float64 inputs on the reference.
    """
    if backend == "auto" and rewards.dtype == torch.float64:
        backend = "reference"
    chosen = resolve(backend, rewards.device, ("cpu", "cuda"))
    if chosen == "cpu":
        return tuple(cpu_extension().gae_forward(rewards, values, mask, gamma, lam, whiten, eps))
    if chosen == "cuda":
        adv, ret = cuda_extension().gae_forward(rewards, values, mask, gamma, lam)
    else:
        adv, ret = gae_reference(rewards, values, mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, mask, eps=eps)
    return adv, ret


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                       backend: str = "auto") -> torch.Tensor:
    """Return-to-go over valid steps [B, T]: GAE with zero values and lam = 1."""
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0, backend)[0]
