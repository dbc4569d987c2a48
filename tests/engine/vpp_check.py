"""Run by test_virtual_pipeline.py under torchrun (the suite's 2-process launch): the engine at pp 2 with
virtual_pp 2 (megatron-core's interleaved schedule, two model chunks per rank) on a 4-layer model with tied
embeddings, so stage 0 holds layers 0 and 2, stage 1 layers 1 and 3 and the tied output layer's copy.

From the same HF checkpoint as the one-rank reference (`reference`): the actor's log-probs and entropy in
micro-batches of 3 (2 micro-batches) and of 4 (1, which the engine pads to a group of pp), a critic's
values, one actor update of 4 micro-batches and its weights gathered back to HF layout, the generation
model at tg = 1 refreshed from them, the HF export streamed stage by stage, and a checkpoint that
resumes exactly (a second update from the restored engine equals the original's second update); and a
critic update of 3 micro-batches, which the engine pads to a group of pp (2) with an empty one.
Rank 0 writes everything to argv[1]; argv[2] is the directory for the HF model and the checkpoint.
"""
import os
import sys

VPP_MODEL = dict(num_hidden_layers=4, tie_word_embeddings=True)


def write_model(path):
    from hybridflow.models.checkpoint import save_hf_checkpoint
    from tests.engine.conftest import tiny_model

    cfg, _, hf = tiny_model(**VPP_MODEL)
    save_hf_checkpoint(hf, cfg.to_hf_dict(), path)
    return path


def compute(parallel, hf_path, ckpt_dir=None) -> dict:
    """What both the launch and the one-rank reference compute."""
    import torch
    import torch.distributed as dist

    from hybridflow.config.schema import CriticConfig, OptimConfig
    from hybridflow.data import fields as F
    from hybridflow.engine import MegatronEngine
    from hybridflow.hybrid_engine import GroupedWeights
    from hybridflow.roles import Actor, Critic
    from tests.engine.conftest import layout_case

    case = layout_case(hf_path)
    engine = MegatronEngine(case.cfg, parallel, case.optim, total_steps=10)
    engine.load_hf_checkpoint(case.path)
    actor = Actor(case.actor_cfg, engine)
    out = dict(actor.compute_log_probs(case.batch, 3))
    out["log_probs_one_micro_batch"] = actor.compute_log_probs(case.batch, 4)["old_log_probs"]
    critic_engine = MegatronEngine(case.cfg, parallel, OptimConfig(lr=1e-2), total_steps=10, value_head=True)
    critic_engine.load_hf_checkpoint(case.path)
    head = critic_engine.local_name("output_layer.weight")
    if head in critic_engine.named_params():  # the last chunk of the last stage: a non-zero value head
        critic_engine.named_params()[head].data.copy_(case.value_head)
    out.update(Critic(CriticConfig(ppo_micro_batch_size=3), critic_engine, mini_batch_size=4)
               .compute_values(case.batch))
    # A critic update of 3 micro-batches: the engine pads them to 4 (a group of pp), scaling the real losses.
    three = {k: v[:3] for k, v in {**case.batch, F.VALUES: out[F.VALUES], F.RETURNS: case.returns}.items()}
    critic = Critic(CriticConfig(ppo_micro_batch_size=1), critic_engine, mini_batch_size=3)
    calls, run = [], critic_engine.run
    critic_engine.run = lambda micro_batches, *a, **k: calls.append(len(micro_batches)) or run(micro_batches, *a, **k)
    out["critic_metrics"] = critic.update(three, 0)
    out["critic_update_micro_batches"] = calls
    del critic_engine.run
    out["values_after_update"] = critic.compute_values(case.batch)[F.VALUES]
    generation = GroupedWeights(engine, 1)
    out["metrics"] = actor.update(case.batch, step=0)
    out["weights"] = engine.hf_state_dict()
    out["transition"] = generation.refresh()
    gen = dict(generation.model.named_parameters())
    trained = engine.bridge.megatron_to_generation(engine.full_state())
    out["fresh_after_refresh"] = all(torch.equal(gen[k], trained[k]) for k in trained)
    if ckpt_dir is not None:
        from hybridflow.models.checkpoint import save_hf_checkpoint_parts

        out["export_dir"] = export = os.path.join(ckpt_dir, "hf_export")
        parts = engine.hf_stage_parts()
        if dist.get_rank() == 0:
            save_hf_checkpoint_parts(parts, engine.layout.pp, case.cfg.to_hf_dict(), export)
        else:
            for _ in parts:
                pass
        out["shards"] = shards = os.path.join(ckpt_dir, "shards")
        engine.save(shards)
        out["second_metrics"] = actor.update(case.batch, step=1)
        restored = MegatronEngine(case.cfg, parallel, case.optim, total_steps=10)
        restored.load(shards)
        out["resumed_metrics"] = Actor(case.actor_cfg, restored).update(case.batch, step=1)
        out["resume_weights_equal"] = all(torch.equal(a, b) for a, b in zip(
            engine.hf_state_dict().values(), restored.hf_state_dict().values()))
        out["chunk_layers"] = [[layer.layer_number - 1 for layer in engine._inner(c).decoder.layers]
                               for c in range(engine.virtual_pp)]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out["chunk_layers"])
        out["chunk_layers"] = everyone
    return out


def main(out_path: str, work_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch
    import torch.distributed as dist

    from hybridflow.engine import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import ParallelConfig
    from hybridflow.parallel import init_process_group

    init_process_group("cpu")
    ps.destroy_model_parallel()  # from the layout of whatever ran before in this launch
    hf = os.path.join(work_dir, "hf")
    if dist.get_rank() == 0:
        write_model(hf)
    dist.barrier()
    out = compute(ParallelConfig(pp=2, virtual_pp=2), hf, work_dir)
    ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(out, out_path)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
