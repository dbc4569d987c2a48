"""One actor update at data-parallel size 2 (run by torchrun from test_data_parallel.py).

Each rank takes its half of a fixed batch; rank 0 writes the updated HF
weights and the reported metrics to argv[1].
"""
import os
import sys

import torch


def main(out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from hybridflow.config.schema import ActorConfig, OptimConfig, ParallelConfig
    from hybridflow.data import fields as F
    from hybridflow.engine import MegatronEngine
    from hybridflow.roles import Actor
    from tests.engine.conftest import dp_case

    cfg, hf, batch, optim, actor_cfg = dp_case()
    engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
    engine.load_hf_state_dict(hf)
    rank, world = engine.layout.dp_rank, engine.layout.dp
    assert world == 2, world
    rows = len(batch[F.INPUT_IDS]) // world
    mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
    metrics = Actor(actor_cfg, engine).update(mine, step=0)
    weights = engine.hf_state_dict()
    if rank == 0:
        torch.save({"weights": weights, "metrics": metrics}, out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
