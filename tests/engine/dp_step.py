"""One actor update at data-parallel size 2 (run by torchrun from test_data_parallel.py).

Each rank takes its share of the global mini-batch of a fixed batch; rank 0 writes the updated HF
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
    from hybridflow.data.batch import rows_for_plan
    from hybridflow.engine import MegatronEngine
    from hybridflow.roles import Actor
    from tests.engine.conftest import dp_case

    cfg, hf, batch, optim, actor_cfg = dp_case()
    engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
    engine.load_hf_state_dict(hf)
    rank, world = engine.coord.dp, engine.layout.dp
    assert world == 2, world
    actor = Actor(actor_cfg, engine)
    rows, steps = rows_for_plan(batch, actor.plan(len(batch[F.INPUT_IDS]), step=0, replicas=world)[rank])
    metrics = actor.update_share(rows, steps)
    weights = engine.hf_state_dict()
    if rank == 0:
        torch.save({"weights": weights, "metrics": metrics}, out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
