"""Run by test_cp_attention.py under `torchrun --nproc-per-node 2`: the engine at cp = 2 (dp = 1).

From the layout tests' HF checkpoint and batch (`conftest.layout_case`; rows of 9 tokens, padded to 12
for 2*cp chunks): the actor's log-probs and entropy, a critic's values, one actor update and the
weights after it. Rank 0 writes them to argv[1] (torch.save) for the test to compare with one rank
(`test_layouts.reference`); every CP rank must report the same.
"""
import sys


def main(out_path: str, hf_path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import CriticConfig, OptimConfig, ParallelConfig
    from hybridflow.data.batch import rows_for_plan
    from hybridflow.engine import MegatronEngine
    from hybridflow.roles import Actor, Critic
    from tests.engine.conftest import layout_case

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    case = layout_case(hf_path)
    parallel = ParallelConfig(cp=2)
    engine = MegatronEngine(case.cfg, parallel, case.optim, total_steps=10)
    engine.load_hf_checkpoint(case.path)
    actor = Actor(case.actor_cfg, engine)
    out = dict(actor.compute_log_probs(case.batch, 3))
    critic_engine = MegatronEngine(case.cfg, parallel, OptimConfig(lr=1e-2), total_steps=10, value_head=True)
    critic_engine.load_hf_checkpoint(case.path)
    critic_engine.named_params()["output_layer.weight"].data.copy_(case.value_head)
    out.update(Critic(CriticConfig(ppo_micro_batch_size=3), critic_engine, mini_batch_size=4).compute_values(
        case.batch))
    rows = len(case.batch["input_ids"])
    mine, steps = rows_for_plan(case.batch, actor.plan(rows, step=0, replicas=engine.layout.dp)[engine.coord.dp])
    out["metrics"] = actor.update_share(mine, steps)
    out["weights"] = engine.hf_state_dict()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: out[k] for k in ("old_log_probs", "values", "metrics")})
    first = everyone[0]
    out["same_on_cp_ranks"] = all(
        torch.equal(e["old_log_probs"], first["old_log_probs"]) and torch.equal(e["values"], first["values"])
        and e["metrics"] == first["metrics"] for e in everyone)
    if dist.get_rank() == 0:
        torch.save(out, out_path)
    ps.destroy_model_parallel()
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
