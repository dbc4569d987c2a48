"""The FSDP2 engine at 2 ranks (run by torchrun from tests/conftest.py's two-process launch).

On the data-parallel case of test_data_parallel.py (`dp_case`): the actor's update with each rank taking
its share of the mini-batch; a frozen reference's log-probs of rows split unevenly over the ranks (so one
rank runs idle passes); the critic's values and update; a checkpoint saved after the update and loaded
into a fresh engine, which then takes a second update that must equal the first engine's second update
bit for bit. Rank 0 writes everything to argv[1]; tests/engine/test_fsdp_engine.py compares it with
megatron-core at one process.
"""
import os
import sys
from pathlib import Path

import torch


def main(out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import dataclasses

    import torch.distributed as dist

    from hybridflow.config.schema import CriticConfig, ReferenceConfig
    from hybridflow.data import fields as F
    from hybridflow.data.batch import rows_for_plan, slice_rows
    from hybridflow.engine.fsdp import FSDPEngine
    from hybridflow.hybrid_engine.fsdp_gather import FSDPGatheredWeights
    from hybridflow.roles import Actor, Critic, Reference
    from tests.engine.conftest import dp_case, grouped_rl_batch

    from hybridflow.parallel.process_group import init_process_group

    init_process_group("cpu")
    cfg, hf, batch, optim, actor_cfg = dp_case()
    rank = dist.get_rank()
    result = {}

    def actor_engine():
        engine = FSDPEngine(cfg, optim, total_steps=10)
        engine.load_hf_state_dict(hf)
        return engine

    def update(actor, step):
        world = actor.engine.layout.dp
        rows, steps = rows_for_plan(batch, actor.plan(len(batch[F.INPUT_IDS]), step=step, replicas=world)[rank])
        return actor.update_share(rows, steps)

    engine = actor_engine()
    assert engine.layout.dp == 2
    local = {n: p.to_local().numel() for n, p in engine.named_params().items()}
    whole = {n: p.numel() for n, p in engine.named_params().items()}
    result["shard_fraction"] = sum(local.values()) / sum(whole.values())
    # The generator's weights (tiny buckets: several all-gathers) before and after the update.
    generation = FSDPGatheredWeights(engine, bucket_bytes=4096)
    generation.release()
    actor = Actor(actor_cfg, engine)
    result["metrics"] = update(actor, 0)
    result["weights"] = engine.hf_state_dict()
    try:
        generation.model(batch[F.INPUT_IDS])
        result["released_generates"] = True
    except RuntimeError:
        result["released_generates"] = False
    stale = {n: p.clone() for n, p in generation.model.named_parameters()}  # freed: empty tensors
    result["refresh"] = generation.refresh()
    gen = dict(generation.model.named_parameters())
    trained = engine.full_generation_state()
    result["generation_equals_trained"] = all(torch.equal(gen[n], trained[n]) for n in trained)
    result["generation_was_freed"] = all(t.numel() == 0 for t in stale.values())
    result["plan_bytes"] = generation.plan_bytes()

    # Resume: save after the first update, load into a fresh engine, both take the second update.
    directory = Path(out).parent / "fsdp_checkpoint"  # every rank is given the same `out`
    engine.save(directory)
    dist.barrier()
    second = update(actor, 1)
    resumed = actor_engine()
    resumed.load(directory)
    again = update(Actor(actor_cfg, resumed), 1)
    result["resume_metrics_equal"] = second == again
    after, resumed_after = engine.hf_state_dict(), resumed.hf_state_dict()
    result["resume_weights_equal"] = all(torch.equal(after[k], resumed_after[k]) for k in after)

    # A frozen reference on rows split 5 / 3: rank 1 runs fewer micro-batches and idles through the rest.
    reference = FSDPEngine(cfg)
    reference.load_hf_state_dict(hf)
    grouped = grouped_rl_batch(cfg.vocab_size)  # 8 rows, prompts shared by 1 to 3 of them
    mine = slice_rows(grouped, 0, 5) if rank == 0 else slice_rows(grouped, 5, 8)
    ref = Reference(ReferenceConfig(log_prob_micro_batch_size=1), reference).compute_ref_log_probs(mine)
    parts = [None, None]
    dist.all_gather_object(parts, ref[F.REF_LOG_PROBS])
    result["ref_log_probs"] = torch.cat(parts)
    # The same rows packed (token-budgeted micro-batches) and prompt-shared.
    for name, overrides in (("packed", dict(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=40)),
                            ("shared", dict(log_prob_share_prompts=True, log_prob_micro_batch_size=4))):
        cfg_ref = dataclasses.replace(ReferenceConfig(log_prob_micro_batch_size=1), **overrides)
        got = Reference(cfg_ref, reference).compute_ref_log_probs(mine)
        dist.all_gather_object(parts, got[F.REF_LOG_PROBS])
        result[f"ref_log_probs_{name}"] = torch.cat(parts)

    # The critic: values, then one update.
    critic_engine = FSDPEngine(cfg, optim, value_head=True, total_steps=10)
    critic_engine.load_hf_state_dict(hf)
    critic_cfg = CriticConfig(optim=optim, ppo_micro_batch_size=1)
    critic = Critic(critic_cfg, critic_engine, mini_batch_size=4)
    data = dict(batch)
    data[F.RETURNS] = torch.randn(batch[F.RESPONSES].shape, generator=torch.Generator().manual_seed(3))
    data[F.VALUES] = torch.zeros(batch[F.RESPONSES].shape)
    rows, steps = rows_for_plan(data, critic.plan(len(data[F.INPUT_IDS]), step=0, replicas=2)[rank])
    result["critic_metrics"] = critic.update_share(rows, steps)
    values = critic.compute_values(mine)[F.VALUES]
    dist.all_gather_object(parts, values)
    result["values_after"] = torch.cat(parts)
    # Loading from an HF checkpoint reads this rank's rows only: the same shards as from the whole tensors.
    from hybridflow.models.checkpoint import save_hf_checkpoint

    hf_dir = Path(out).parent / "fsdp_hf"
    if rank == 0:
        save_hf_checkpoint(hf, cfg.to_hf_dict(), hf_dir)
    dist.barrier()
    same, fractions = True, []
    for value_head in (False, True):
        from_file, from_dict = FSDPEngine(cfg, value_head=value_head), FSDPEngine(cfg, value_head=value_head)
        fractions.append(from_file.load_hf_checkpoint(hf_dir) / sum(t.numel() * t.element_size() for t in hf.values()))
        from_dict.load_hf_state_dict(hf)
        mine, theirs = from_file.named_params(), from_dict.named_params()
        same &= all(torch.equal(mine[n].to_local(), theirs[n].to_local()) for n in mine if n != "head.weight")
    result["checkpoint_shards_equal"], result["checkpoint_read_fraction"] = same, fractions

    # The actor on the transformers model code (engine/fsdp_hf.py), its generator refreshed after the update.
    from hybridflow.engine.fsdp_hf import TransformersFSDPEngine

    hf_engine = TransformersFSDPEngine(hf_dir, cfg, optim, total_steps=10)
    result["transformers_read_fraction"] = (hf_engine.load_hf_checkpoint(hf_dir)
                                            / sum(t.numel() * t.element_size() for t in hf.values()))
    hf_generation = FSDPGatheredWeights(hf_engine, bucket_bytes=4096)
    result["transformers_metrics"] = update(Actor(actor_cfg, hf_engine), 0)
    result["transformers_weights"] = hf_engine.hf_state_dict()
    result["transformers_refresh"] = hf_generation.refresh()
    result["transformers_plan_bytes"] = hf_generation.plan_bytes()
    fused = dict(hf_engine.bridge.fuse_stream(result["transformers_weights"].items()))
    result["transformers_generation_equals_trained"] = all(
        torch.equal(p, fused[n]) for n, p in hf_generation.model.named_parameters())

    # Mixed precision: bfloat16 compute over float32 parameters and Adam state.
    bf16 = FSDPEngine(cfg, optim, dtype="bfloat16", total_steps=10)
    bf16.load_hf_state_dict(hf)
    result["bf16_metrics"] = update(Actor(actor_cfg, bf16), 0)
    result["bf16_param_dtypes"] = sorted({str(p.dtype) for p in bf16.module.parameters()})
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
