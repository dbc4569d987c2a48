"""The engine at TP2xPP2, TP2xDP2 and PP2xDP2 (4 gloo processes, one launch) and at TP2 with sequence
parallelism (2 processes) equals the one-rank engine."""
import pytest
import torch

from hybridflow.config.schema import CriticConfig, OptimConfig, ParallelConfig
from hybridflow.data import fields as F
from hybridflow.engine import MegatronEngine
from hybridflow.roles import Actor, Critic
from tests.engine.conftest import layout_case

pytestmark = pytest.mark.usefixtures("megatron_world")
LAYOUTS = ("tp2_pp2", "tp2_pp1", "tp1_pp2")


@pytest.fixture(scope="module")
def one_rank(layouts_hf):
    return reference(layouts_hf)


@pytest.fixture(scope="module")
def launched(four_process_launch, one_rank):
    """layouts_check.py's results over every layout (in the suite's one 4-process launch); and the one-rank
    reference."""
    return torch.load(four_process_launch["layouts"]), one_rank


def reference(hf_path) -> dict:
    case = layout_case(hf_path)
    engine = MegatronEngine(case.cfg, ParallelConfig(), case.optim, total_steps=10)
    out = {"bytes_read": engine.load_hf_checkpoint(case.path)}
    actor = Actor(case.actor_cfg, engine)
    out.update(actor.compute_log_probs(case.batch, 3))
    out["shared_log_probs"] = actor.compute_log_probs(case.grouped, 3)["old_log_probs"]  # padded, one rank
    out["grouped_mask"] = case.grouped["response_mask"].bool()
    out["response_mask"] = case.batch["response_mask"].bool()
    critic_engine = MegatronEngine(case.cfg, ParallelConfig(), OptimConfig(lr=1e-2), total_steps=10,
                                   value_head=True)
    critic_engine.load_hf_checkpoint(case.path)
    critic_engine.named_params()["output_layer.weight"].data.copy_(case.value_head)
    critic = Critic(CriticConfig(ppo_micro_batch_size=3), critic_engine, mini_batch_size=4)
    out.update(critic.compute_values(case.batch))
    out["critic_metrics"] = critic.update({**case.batch, F.VALUES: out[F.VALUES], F.RETURNS: case.returns}, 0)
    out["metrics"] = actor.update(case.batch, step=0)
    out["weights"] = engine.hf_state_dict()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_passes_equal_one_rank(launched, layout):
    got, want = launched[0][layout], launched[1]
    for key in ("old_log_probs", "entropy", "values"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=f"{layout} {key}")


@pytest.mark.timeout(600)
def test_shared_prompt_rows_at_tensor_parallel_2_equal_one_padded_rank(launched):
    """GRPO-shaped rows (4 prompts, 8 rows) run as shared-prompt rows at TP2 (DP2) give the one-rank padded
    log-probs: the per-token RoPE angles and the gather of vocab-parallel logits hold under TP."""
    got, want = launched[0]["tp2_pp1"], launched[1]
    mask = want["grouped_mask"]
    torch.testing.assert_close(got["shared_log_probs"][mask], want["shared_log_probs"][mask], atol=1e-5, rtol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_update_equals_one_rank(launched, layout):
    got, want = launched[0][layout], launched[1]
    assert got["metrics"]["actor/grad_norm"] == pytest.approx(want["metrics"]["actor/grad_norm"], rel=1e-5)
    # pg_loss is summed over DP replicas; entropy is each replica's own mean, so only dp=1 matches it.
    for key in ("actor/pg_loss",) + (("actor/entropy",) if layout == "tp2_pp2" else ()):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7), key
    assert got["weights"].keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, atol=1e-6, rtol=0, msg=f"{layout} {name}")
    assert got["metrics_keys_same_on_all_ranks"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_gather_generation_is_stale_until_refreshed_then_exact(launched, layout):
    got = launched[0][layout]
    assert got["stale_before_refresh"]  # the check below can fail: the update changed the weights
    assert got["fresh_after_refresh"]
    transition = got["transition"]
    assert transition["reshard/bytes_received"] > 0 and transition["reshard/collectives"] > 0


@pytest.mark.timeout(600)
def test_each_rank_reads_only_its_slices(launched):
    full = launched[1]["bytes_read"]
    for layout in LAYOUTS:
        assert launched[0][layout]["bytes_read"] < 0.75 * full, layout  # rank 0's shard, not the model


@pytest.mark.timeout(600)
def test_tp2_pp2_hf_export_is_streamed_stage_by_stage_and_exact(launched):
    from pathlib import Path

    from hybridflow.models.checkpoint import load_hf_state_dict

    got = launched[0]["tp2_pp2"]
    files = sorted(p.name for p in Path(got["export_dir"]).glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # one per stage
    exported = load_hf_state_dict(got["export_dir"])
    assert exported.keys() == got["weights"].keys()
    for name, value in got["weights"].items():
        assert torch.equal(exported[name], value), name


@pytest.mark.timeout(600)
def test_checkpoints_resume_exactly_with_and_without_the_distributed_optimizer(launched):
    for layout, sharded in (("tp2_pp2", False), ("tp2_pp1", True)):  # dp 1 and dp 2
        got = launched[0][layout]
        assert got["distributed_optimizer"] is sharded, layout
        assert got["resume_metrics_equal"] and got["resume_weights_equal"], layout


@pytest.fixture(scope="module")
def sequence_parallel(two_process_launch, one_rank):
    """layouts_check.py at TP2 (dp 1) with and without sequence parallelism (in the 2-process launch); and
    the one-rank reference."""
    got = torch.load(two_process_launch["sp_layouts"])
    return got["tp2_pp1_sp"], got["tp2_pp1"], one_rank


@pytest.mark.timeout(600)
def test_sequence_parallel_at_tp2_equals_tp2_and_one_rank(sequence_parallel):
    """Every output and learned metric, the gradient norm and the updated weights at TP2 with sequence
    parallelism equal TP2 without it and one rank (fp32). The batch's 9 columns do not divide by tp, so this
    also covers the padding `pad_columns` adds; its packed and shared-prompt rows, and the critic's value head
    (which gathers the sequence itself) in its forward pass and update, run split too."""
    sp, plain, want = sequence_parallel
    assert (sp["final_norm_columns"], plain["final_norm_columns"]) == (5, 9)  # 9 columns padded to 10, split
    mask = want["grouped_mask"]
    for other in (plain, want):
        for key in ("old_log_probs", "entropy", "values"):
            torch.testing.assert_close(sp[key], other[key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(sp["shared_log_probs"][mask], other["shared_log_probs"][mask], atol=1e-5, rtol=0)
        response = want["response_mask"]
        torch.testing.assert_close(sp["packed_log_probs"][response], other["old_log_probs"][response],
                                   atol=1e-5, rtol=0)
        assert sp["metrics"].keys() == other["metrics"].keys()
        for key, value in other["metrics"].items():  # dp 1: every metric is the one rank's
            assert sp["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
        for name, value in other["weights"].items():
            torch.testing.assert_close(sp["weights"][name], value, atol=1e-6, rtol=0, msg=name)
        # The critic's grad norm would double were the value head's backward to sum its gradient over TP.
        for key, value in other["critic_metrics"].items():
            assert sp["critic_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    assert sp["fresh_after_refresh"] and sp["resume_metrics_equal"] and sp["resume_weights_equal"]
