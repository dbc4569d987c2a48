"""The CUDA paths outside the kernels (pytest -m gpu; skipped without a CUDA device).

- the built-in generator runs where its model lives and answers where the
  prompts came from: a CUDA model given the controller's CPU batch returns
  CPU tensors equal to the CPU model's (keyed sampling);
- the demo's GRPO run on CUDA (local launcher, NCCL, megatron-core on the
  GPU, the CUDA log-prob kernel) follows the CPU run of the same commit:
  per-step rewards and the held-out accuracy within a token flip's worth.
  The CPU side runs in a subprocess with CUDA hidden, as `make demo` does.

Both failed before the first GPU run found them: generation indexed a CUDA
embedding with CPU ids, and the local worker group hid CUDA from its workers.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.rollout import Generator, SamplingParams
from tests.rollout.conftest import PAD, left_padded_prompts, tiny_decoder

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def test_cuda_generation_takes_and_returns_cpu_batches():
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    keys = torch.tensor([11, 22, 33, 44])
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.95, n=3)
    on_cpu = Generator(model, PAD).generate(ids, mask, params, row_keys=keys)
    on_gpu = Generator(tiny_decoder("llama-gqa").cuda(), PAD).generate(ids, mask, params, row_keys=keys)
    for name in ("prompts", "prompt_mask", "responses", "response_mask", "log_probs"):
        a, b = getattr(on_cpu, name), getattr(on_gpu, name)
        assert b.device.type == "cpu", name
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=name)


def _demo(tmp_path: Path, device: str, steps: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = tmp_path / device
    subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", "configs/demo.yaml", f"trainer.device={device}",
                    f"trainer.total_steps={steps}", f"trainer.val_every={steps}", "trainer.save_every=0",
                    f"trainer.output_dir={out}", "trainer.overwrite=true", "trainer.loggers=[jsonl]"],
                   cwd=ROOT, env=env, check=True, timeout=300)
    return [json.loads(line) for line in (out / "demo" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_demo_on_cuda_follows_the_cpu_run(tmp_path):
    cpu, gpu = _demo(tmp_path, "cpu", 8), _demo(tmp_path, "cuda", 8)
    rewards = [(c["reward/mean"], g["reward/mean"]) for c, g in zip(cpu, gpu) if "reward/mean" in c]
    assert len(rewards) == 8
    assert max(abs(c - g) for c, g in rewards) < 0.03, rewards
    assert abs(cpu[-1]["val/accuracy"] - gpu[-1]["val/accuracy"]) < 0.02
