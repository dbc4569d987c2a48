"""FSDP checkpoints for the reshard tool (run by torchrun in tests/conftest.py's two-process launch).

At 2 ranks: an actor and a critic FSDP engine of the tiny Llama (untied lm_head), each loaded from its HF
weights and moved by one optimizer step (so the weights are not the HF ones and Adam's state is in the
checkpoint beside them), saved as a trainer's step (`checkpoints/step_000001/{actor,critic}/`, trainer.json,
`latest`); beside it, what the engines hold, gathered whole (the actor's `hf_state_dict()`, the critic's
generation tensors and value head). Then the FSDP checkpoint the tool wrote from the HF model before the
launch (`write_from_hf`) is loaded into a fresh engine at this world size, and its HF weights saved too.
Rank 0 writes everything under argv[1]; tests/reshard/test_reshard_fsdp.py converts and compares.
"""
import json
import os
import sys
from pathlib import Path

import torch

STEP = 1


def write_from_hf(directory: Path) -> None:
    """Before the launch, in the test process: the tiny model as HF (`hf/`, also the --config of the
    checkpoints above) and, converted by the tool, as an FSDP checkpoint (`from_hf/`)."""
    from hybridflow.models.checkpoint import save_hf_checkpoint
    from hybridflow.reshard.cli import main
    from tests.engine.conftest import tiny_model

    cfg, _, hf = tiny_model()
    save_hf_checkpoint(hf, cfg.to_hf_dict(), directory / "hf")
    main([str(directory / "hf"), str(directory / "from_hf"), "--to", "fsdp", "--no-progress"])


def one_step(engine, batch, rank: int) -> None:
    """One update on this rank's two rows (any differentiable loss: only the weights' change matters)."""
    from hybridflow.data import fields as F

    rows = {k: v[2 * rank: 2 * rank + 2] for k, v in batch.items()}

    def step_fn(output, mb):
        loss = (output.float() - 1.0).pow(2).mean()
        return loss, {"loss": loss.item()}

    engine.zero_grad()
    engine.run([{F.INPUT_IDS: rows[F.INPUT_IDS], F.ATTENTION_MASK: rows[F.ATTENTION_MASK]}], step_fn)
    engine.step()


def main(out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch.distributed as dist

    from hybridflow.checkpoint.format import LATEST, TRAINER_STATE, model_table, step_dirname, trainer_state
    from hybridflow.config.schema import OptimConfig
    from hybridflow.engine.fsdp import FSDPEngine
    from hybridflow.parallel.process_group import init_process_group
    from tests.engine.conftest import rl_batch, tiny_model

    init_process_group("cpu")
    rank = dist.get_rank()
    out = Path(out)
    cfg, _, hf = tiny_model()
    batch = rl_batch(cfg.vocab_size)
    optim = OptimConfig(lr=1e-2)
    root = out / "checkpoints"
    step_dir = root / step_dirname(STEP)
    result = {}
    for role, value_head in (("actor", False), ("critic", True)):
        engine = FSDPEngine(cfg, optim, value_head=value_head, total_steps=4)
        engine.load_hf_state_dict(hf)
        one_step(engine, batch, rank)
        engine.save(step_dir / role)
        if value_head:
            result["critic_generation"] = engine.full_generation_state()
            result["critic_head"] = engine.module.head.weight.full_tensor()
        else:
            result["actor_hf"] = engine.hf_state_dict()
    dist.barrier()
    if rank == 0:
        models = {role: model_table(cfg, 128, role == "critic") for role in ("actor", "critic")}
        (step_dir / TRAINER_STATE).write_text(json.dumps(trainer_state(STEP, models, {}, kl_coef=0.05)))
        (root / LATEST).write_text(step_dirname(STEP))

    loaded = FSDPEngine(cfg, optim, total_steps=4)
    loaded.load(out / "from_hf")
    result["from_hf"] = loaded.hf_state_dict()
    if rank == 0:
        torch.save(result, out / "weights.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
