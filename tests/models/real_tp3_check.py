"""Run by test_real_model.py under `torchrun --nproc-per-node 3`: SmolLM2-135M at TP = 3 (9 heads, 3 KV heads).

Each rank loads its slice of the real checkpoint, computes the actor's log-probs and entropy on the shared
batch, takes one update and gathers the watched weights back to HF layout. Rank 0 writes them to argv[1].
"""
import os
import sys


def main(out_path: str, model_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch
    import torch.distributed as dist

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.models import DecoderConfig
    from hybridflow.parallel import init_process_group
    from hybridflow.roles import Actor
    from tests.models.real_case import WATCHED, real_batch, update_case

    init_process_group("cpu")
    batch, actor_cfg = update_case(real_batch(model_dir))
    engine = MegatronEngine(DecoderConfig.from_pretrained(model_dir), ParallelConfig(tp=3), actor_cfg.optim,
                            total_steps=10)
    engine.load_hf_checkpoint(model_dir)
    actor = Actor(actor_cfg, engine)
    out = {"tp": engine.layout.tp, "shard_rows": engine.named_params()["embedding.word_embeddings.weight"].shape[0]}
    out.update(actor.compute_log_probs(batch, 3))
    out["metrics"] = actor.update(batch, step=0)
    weights = engine.hf_state_dict()
    out["weights"] = {k: weights[k].clone() for k in WATCHED}
    if dist.get_rank() == 0:
        torch.save(out, out_path)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
