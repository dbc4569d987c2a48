"""The FSDP2 engine (engine/fsdp.py) against megatron-core at one process, on the roles' own code.

The 2-rank side runs in the session's two-process launch (tests/engine/fsdp_check.py). The two engines are
two computations of the same function (hybridflow's decoder and megatron-core's GPTModel, in float32), so
figures agree to float32 rounding, not bit for bit: metrics within rel 1e-5, log-probs and values within
1e-5 absolute (they are O(1-10)), and weights after Adam's first step within 5% of the learning rate
(that step is ~lr * sign(grad), and a gradient within rounding of 0 may flip sign, as in
test_data_parallel.py). A resumed FSDP run is the same computation: there `==`.
"""
import pytest
import torch

from hybridflow.config.schema import CriticConfig, ParallelConfig, ReferenceConfig
from hybridflow.data import fields as F
from hybridflow.data.batch import rows_for_plan
from hybridflow.engine import MegatronEngine
from hybridflow.roles import Actor, Critic, Reference
from tests.engine.conftest import assert_one_adam_step_close, dp_case, grouped_rl_batch

pytestmark = [pytest.mark.usefixtures("megatron_world"), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fsdp(two_process_launch):
    return torch.load(two_process_launch["fsdp"])


def _close_metrics(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_an_fsdp_actor_at_two_ranks_updates_as_megatron_core_at_one_process(fsdp):
    cfg, hf, batch, optim, actor_cfg = dp_case()
    engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
    engine.load_hf_state_dict(hf)
    metrics = Actor(actor_cfg, engine).update(batch, step=0)
    _close_metrics(fsdp["metrics"], metrics)
    assert_one_adam_step_close(fsdp["weights"], engine.hf_state_dict(), hf, optim.lr)
    assert fsdp["shard_fraction"] == pytest.approx(0.5, abs=0.01)  # each rank holds half of every tensor


def test_an_fsdp_checkpoint_resumes_bit_exact(fsdp):
    """Saved (torch DCP) after one update and loaded into a fresh engine: the next update's metrics and
    weights equal those of the engine that never stopped."""
    assert fsdp["resume_metrics_equal"] and fsdp["resume_weights_equal"]


def test_a_frozen_fsdp_reference_scores_uneven_shares_as_one_megatron_process(fsdp):
    """Rows split 5 / 3 over the ranks, one per micro-batch: the rank with 3 runs two idle passes so that
    every all-gather has both ranks. Plain, packed and prompt-shared micro-batches all agree with megatron-core."""
    cfg, hf, _, _, _ = dp_case()
    engine = MegatronEngine(cfg, ParallelConfig())
    engine.load_hf_state_dict(hf)
    batch = grouped_rl_batch(cfg.vocab_size)
    want = Reference(ReferenceConfig(log_prob_micro_batch_size=1), engine).compute_ref_log_probs(batch)
    real = batch[F.RESPONSE_MASK].bool()
    for key in ("ref_log_probs", "ref_log_probs_packed", "ref_log_probs_shared"):
        torch.testing.assert_close(fsdp[key][real], want[F.REF_LOG_PROBS][real], atol=1e-5, rtol=0, msg=key)


def test_an_fsdp_critic_at_two_ranks_trains_as_megatron_core_at_one_process(fsdp):
    cfg, hf, batch, optim, _ = dp_case()
    engine = MegatronEngine(cfg, ParallelConfig(), optim, value_head=True, total_steps=10)
    engine.load_hf_state_dict(hf)
    critic = Critic(CriticConfig(optim=optim, ppo_micro_batch_size=1), engine, mini_batch_size=4)
    data = dict(batch)
    data[F.RETURNS] = torch.randn(batch[F.RESPONSES].shape, generator=torch.Generator().manual_seed(3))
    data[F.VALUES] = torch.zeros(batch[F.RESPONSES].shape)
    rows, steps = rows_for_plan(data, critic.plan(len(data[F.INPUT_IDS]), step=0, replicas=1)[0])
    _close_metrics(fsdp["critic_metrics"], critic.update_share(rows, steps))
    values = critic.compute_values(grouped_rl_batch(cfg.vocab_size))[F.VALUES]
    # After one Adam step of lr 1e-2 from a zero head the values are O(0.1): equal to within that step's
    # sign-flip allowance carried through the model.
    torch.testing.assert_close(fsdp["values_after"], values, atol=2e-3, rtol=0)


def test_the_fsdp_generator_holds_the_trained_weights_after_a_refresh_and_nothing_before(fsdp):
    """The switch to generation gathers every rank's chunks into a whole model, bit for bit the trained
    weights (an invariant, not an alias: the generator owns a copy); released for training, it holds no
    weights and refuses to generate; each rank received exactly the plan's bytes over several buckets."""
    assert fsdp["generation_equals_trained"]
    assert fsdp["generation_was_freed"] and not fsdp["released_generates"]
    metrics = fsdp["refresh"]
    assert metrics["reshard/bytes_received"] == fsdp["plan_bytes"] == metrics["reshard/plan_bytes"]
    assert metrics["reshard/collectives"] > 1  # 4 KiB buckets: one all-gather each


def test_fsdp_mixed_precision_computes_in_bfloat16_over_float32_parameters(fsdp):
    """dtype bfloat16: FSDP casts each gathered block to bfloat16 for compute and reduces gradients in
    float32; parameters and Adam state stay float32. The update's metrics are the float32 run's to bfloat16's
    precision (8 mantissa bits, ~0.4% per rounding, a few % through the model and the loss)."""
    assert fsdp["bf16_param_dtypes"] == ["torch.float32"]
    for key, value in fsdp["metrics"].items():
        assert fsdp["bf16_metrics"][key] == pytest.approx(value, rel=0.1, abs=1e-3), key
    assert fsdp["bf16_metrics"] != fsdp["metrics"]  # it did compute in bfloat16


def test_loading_an_hf_checkpoint_reads_only_this_ranks_rows(fsdp):
    """`load_hf_checkpoint` (actor and critic: the value model has no output layer to load) gives the same
    shards as slicing the whole tensors, and each rank reads about half the checkpoint (qkv, [gate; up] and
    the rest by the rows its chunk comes from; the critic skips the output layer)."""
    assert fsdp["checkpoint_shards_equal"]
    actor, critic = fsdp["checkpoint_read_fraction"]
    assert 0.45 < actor < 0.56 and critic < actor, fsdp["checkpoint_read_fraction"]


def test_both_engines_follow_one_lr_schedule_with_warmup_and_cosine_decay():
    """The schedule is one function (`engine.build.lr_scheduler`) over either engine's optimizer: six steps
    of warmup 2 then cosine decay report the same learning rates (one computation: `==`)."""
    from hybridflow.config.schema import OptimConfig
    from hybridflow.engine.fsdp import FSDPEngine

    cfg, hf, batch, _, actor_cfg = dp_case()
    optim = OptimConfig(lr=1e-3, min_lr=1e-5, warmup_steps=2, lr_schedule="cosine")
    rates = {}
    for name, engine in (("fsdp", FSDPEngine(cfg, optim, total_steps=6)),
                         ("megatron", MegatronEngine(cfg, ParallelConfig(), optim, total_steps=6))):
        engine.load_hf_state_dict(hf)
        rates[name] = [engine.step().lr for _ in range(6)]
    assert rates["fsdp"] == rates["megatron"]
    assert rates["fsdp"][0] == 0.0 and max(rates["fsdp"]) == pytest.approx(1e-3) and rates["fsdp"][-1] < 1e-3
