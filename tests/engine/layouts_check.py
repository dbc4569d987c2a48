"""Run by test_layouts.py under torchrun: the engine at several layouts in one launch.

For each layout (on 4 processes TP2xPP2, TP2xDP2, PP2xDP2; on 2, TP2 with and
without sequence parallelism) the ranks rebuild megatron-core's parallel state
and, from the same HF checkpoint (read slice by slice):

- log-probs and entropy of the actor, values of a critic, on the whole batch
  (at dp = pp = 1 also one critic update);
  at pp = 1 also the log-probs of GRPO-shaped rows run as shared-prompt rows,
  and of the batch packed (rows of 14 and 9 tokens);
- one actor update, each DP replica on its share of the batch, then the
  weights gathered back to HF layout;
- the generation model at tg = 1 (the whole model on every rank): stale after the update until refreshed,
  then equal to the trained weights (the invariant of weights shared between
  training and generation);
- at TP2xPP2 (dp 1: plain Adam) and TP2 (on 4 processes dp 2: the distributed
  optimizer's sharded state): a checkpoint of the shard resumes exactly (a
  second update from the restored engine equals the second update of the original).

Rank 0 writes everything to argv[1] for the test to compare with one rank;
argv[2] is the HF checkpoint the test wrote (`conftest.write_layout_model`);
argv[3], if given, the layouts: comma-separated `tp{n}_pp{n}`, `_sp` appended
for sequence parallelism (default: the 4-process ones).
"""
import os
import sys


def run_layout(tp: int, pp: int, hf_path: str, ckpt_dir: str, sp: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import CriticConfig, OptimConfig, ParallelConfig
    from hybridflow.data import fields as F
    from hybridflow.data.batch import rows_for_plan
    from hybridflow.engine import MegatronEngine
    from hybridflow.hybrid_engine import GroupedWeights
    from hybridflow.roles import Actor, Critic
    from tests.engine.conftest import layout_case

    case = layout_case(hf_path)
    parallel = ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp)
    actor_engine = MegatronEngine(case.cfg, parallel, case.optim, total_steps=10)
    read = actor_engine.load_hf_checkpoint(case.path)
    actor = Actor(case.actor_cfg, actor_engine)
    out = {"bytes_read": read, "distributed_optimizer": actor_engine.distributed_optimizer}
    if ps.is_pipeline_last_stage():  # the sequence columns the final norm sees: S / tp under sequence parallelism
        def columns(module, args, output):
            out.setdefault("final_norm_columns", args[0].shape[0])

        actor_engine.module.decoder.final_layernorm.register_forward_hook(columns)
    out.update(actor.compute_log_probs(case.batch, 3))
    if pp == 1:  # shared-prompt rows under TP: per-token RoPE angles and the gather of vocab-parallel logits
        out["shared_log_probs"] = actor.compute_log_probs(case.grouped, 8, share_prompts=True)["old_log_probs"]
        out["packed_log_probs"] = actor.compute_log_probs(case.batch, 4, max_tokens=16)["old_log_probs"]  # 14 + 9
    critic_engine = MegatronEngine(case.cfg, parallel, OptimConfig(lr=1e-2), total_steps=10, value_head=True)
    critic_engine.load_hf_checkpoint(case.path)
    if ps.is_pipeline_last_stage():  # a non-zero value head, so the values say something
        critic_engine.named_params()["output_layer.weight"].data.copy_(case.value_head)
    critic = Critic(CriticConfig(ppo_micro_batch_size=3), critic_engine, mini_batch_size=4)
    out.update(critic.compute_values(case.batch))
    if pp == 1 and actor_engine.layout.dp == 1:  # the value head's backward (under SP, of the gathered sequence)
        out["critic_metrics"] = critic.update({**case.batch, F.VALUES: out[F.VALUES], F.RETURNS: case.returns}, 0)

    generation = GroupedWeights(actor_engine, 1)  # tg = 1: every rank gathers the whole model
    layout = actor_engine.layout
    rows = len(case.batch["input_ids"])
    mine, steps = rows_for_plan(case.batch, actor.plan(rows, step=0, replicas=layout.dp)[actor_engine.coord.dp])
    out["metrics"] = actor.update_share(mine, steps)
    out["weights"] = actor_engine.hf_state_dict()
    gen = dict(generation.model.named_parameters())
    trained = actor_engine.bridge.megatron_to_generation(actor_engine.full_state())
    out["stale_before_refresh"] = any(not torch.equal(gen[k], trained[k]) for k in trained)
    out["transition"] = generation.refresh()
    out["fresh_after_refresh"] = all(torch.equal(gen[k], trained[k]) for k in trained)

    if tp == 2 and pp == 2:
        import torch.distributed as dist

        from hybridflow.models.checkpoint import save_hf_checkpoint_parts

        export = os.path.join(ckpt_dir, "hf_export")
        parts = actor_engine.hf_stage_parts()
        if dist.get_rank() == 0:
            save_hf_checkpoint_parts(parts, pp, case.cfg.to_hf_dict(), export)
        else:
            for _ in parts:
                pass
        out["export_dir"] = export
    if (tp, pp) in ((2, 2), (2, 1)):
        shards = os.path.join(ckpt_dir, f"tp{tp}_pp{pp}" + "_sp" * sp)
        actor_engine.save(shards)
        steps = actor.plan(rows, step=1, replicas=layout.dp)[actor_engine.coord.dp]
        again = actor.update_share(*rows_for_plan(case.batch, steps))
        restored = MegatronEngine(case.cfg, parallel, case.optim, total_steps=10)
        restored.load(shards)
        resumed = Actor(case.actor_cfg, restored).update_share(*rows_for_plan(case.batch, steps))
        out["resume_metrics_equal"] = again == resumed
        out["resume_weights_equal"] = all(torch.equal(a, b) for a, b in zip(
            actor_engine.hf_state_dict().values(), restored.hf_state_dict().values()))
    out["metrics_keys_same_on_all_ranks"] = _same_everywhere(sorted(out["metrics"]))
    dist.barrier()
    return out


def _same_everywhere(value) -> bool:
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return all(v == everyone[0] for v in everyone)


def main(out_path: str, hf_path: str, layouts: str = "tp2_pp2,tp2_pp1,tp1_pp2") -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import tempfile

    import torch
    import torch.distributed as dist

    from hybridflow.engine import cpu_compat

    cpu_compat.apply()  # before megatron-core's first import: its torch.compile wrappers cost seconds
    from megatron.core import parallel_state as ps

    from hybridflow.parallel import init_process_group

    init_process_group("cpu")
    results = {}
    ckpt_dir = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    box = [ckpt_dir]
    dist.broadcast_object_list(box, src=0)
    for name in layouts.split(","):
        tp, pp, *sp = name.split("_")
        ps.destroy_model_parallel()  # from the layout of whatever ran before in this launch (dp_step.py: tp 1)
        results[name] = run_layout(int(tp[2:]), int(pp[2:]), hf_path, box[0], sp=sp == ["sp"])
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
