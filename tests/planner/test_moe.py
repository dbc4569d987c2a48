"""The planner on mixture-of-experts models: parameters and training state per rank at expert parallelism, the
token dispatcher's and the experts' switch bytes, ep as a searched dimension, and the dry-run's per-rank count
against megatron-core's own model built by the engine at ep2."""
import dataclasses
import json

import pytest

from hybridflow.config.loader import load_config
from hybridflow.models.config import DecoderConfig
from hybridflow.parallel.layout import ParallelDims
from hybridflow.planner import cli, cost, roles
from hybridflow.planner.devices import get_device
from hybridflow.planner.dryrun import dry_run, meta_decoder, stage_numel
from hybridflow.planner.roles import Workload
from hybridflow.planner.search import Planner, expert_parallel_sizes
from tests.planner.test_cost import KNOWN
from tests.torchrun import torchrun

QWEN3_MOE = DecoderConfig.from_hf_dict(KNOWN["Qwen3-30B-A3B"])
TINY_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 50, "hidden_size": 32,
            "intermediate_size": 64, "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2,
            "norm_topk_prob": True, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False}
PLAN_30B = ["configs/qwen2.5-0.5b-grpo-gsm8k.yaml", "model.path=models/Qwen3-30B-A3B", "trainer.n_devices=16",
            "data.max_prompt_length=512", "data.max_response_length=512", "actor.log_prob_micro_batch_size=8",
            "--gpus", "16", "--device", "h100"]


def test_experts_divide_over_ep_in_the_per_rank_count():
    """Qwen3-30B-A3B: every layer's 128 experts of 3 x 2048 x 768 are 603,979,776 parameters; at ep the rank
    holds ep-th of them (each TP-split as an MLP), the rest as at ep 1. The meta decoder, keeping rank 0's
    block of experts, counts the same per stage."""
    per_layer = 3 * 2048 * 768 * 128
    assert cost.expert_params(QWEN3_MOE) == per_layer == 603_979_776
    for tp, ep in ((1, 8), (2, 4), (4, 2)):
        dense = cost.layer_params(QWEN3_MOE, tp) - per_layer // tp
        assert cost.layer_params(QWEN3_MOE, tp, ep) == dense + per_layer // (tp * ep)
        assert cost.rank_expert_params(QWEN3_MOE, tp, 2, ep) == per_layer // (tp * ep) * 24
    model = meta_decoder(QWEN3_MOE, 2)
    for stage in range(2):
        assert cost.stage_params(QWEN3_MOE, stage, 2, 2, ep=4) == stage_numel(model, stage, 2, ep=4)
    assert stage_numel(model, 0, 2, ep=1) == cost.stage_params(QWEN3_MOE, 0, 2, 2)
    dense = DecoderConfig.from_hf_dict(KNOWN["Qwen3-8B"])
    assert cost.expert_params(dense) == 0 and cost.layer_params(dense, 2, 4) == cost.layer_params(dense, 2)


def test_training_state_at_ep_splits_weights_and_gradients_not_the_sharded_optimizer():
    """Weights and fp32 gradients of the experts shrink ep-fold; the distributed optimizer already shards the
    experts' Adam state over the expert-data-parallel ranks (dp / ep), so a rank holds the same 12 bytes per
    expert parameter over dp as at ep 1."""
    cfg = load_config("configs/qwen2.5-0.5b-grpo-gsm8k.yaml", ["model.path=models/Qwen3-30B-A3B"])
    wl = Workload.from_config(cfg)
    layout = ParallelDims(tp=2, pp=1, dp=8)
    one, eight = (roles.train_memory(QWEN3_MOE, wl, layout, 1, ep=ep) for ep in (1, 8))
    experts = cost.rank_expert_params(QWEN3_MOE, 2, 1)
    assert one["weights"] - eight["weights"] == experts * 7 // 8 * 2
    assert one["grads"] - eight["grads"] == experts * 7 // 8 * 4
    rest = cost.rank_params(QWEN3_MOE, 2) - experts
    assert eight["optimizer"] == -(-rest * 12 // 8) + experts // 8 * 12 == pytest.approx(one["optimizer"], rel=1e-6)


def test_dispatch_and_expert_switch_bytes_are_the_formulas():
    """The allgather dispatcher: each rank receives the other ep - 1 ranks' tokens (hidden state out and back,
    fp32 probabilities and the routing map over the 128 experts); the switch: (ep - 1) / ep * X / tp
    (docs/design.md), X every layer's experts in bf16."""
    h, e = 2048, 128
    assert cost.dispatch_bytes_per_token(QWEN3_MOE, 8, 2) == 7 * (2 * h * 2 + e * 5)
    assert cost.dispatch_bytes_per_token(QWEN3_MOE, 8, 2, backward=True) == 7 * (2 * h * 2 + e * 4)
    assert cost.dispatch_bytes_per_token(QWEN3_MOE, 1, 2) == 0
    assert cost.alltoall_bytes_per_token(QWEN3_MOE, 8, 2) == 2 * 8 * 7 / 8 * h * 2
    x = 603_979_776 * 48 * 2
    assert cost.expert_transition_bytes(QWEN3_MOE, 2, 4, 2) == 3 / 4 * x / 2
    assert cost.expert_transition_bytes(QWEN3_MOE, 2, 1, 2) == 0
    h100 = get_device("h100")
    # one node (tp x ep <= 8) rides NVLink, two ride the NICs
    inside = cost.dispatch_time(QWEN3_MOE, 4096, 1, 8, 2, h100)
    assert cost.dispatch_time(QWEN3_MOE, 4096, 2, 8, 2, h100) > 5 * inside


def test_ep_is_searched_where_hybridflow_builds_it():
    """ep divides the experts and the data- x context-parallel ranks of a stage (config/validate_moe.py's
    rules), at any pp and placement; 1 only for a dense model."""
    assert expert_parallel_sizes(QWEN3_MOE, ParallelDims(tp=1, pp=1, dp=16), "colocated") == [1, 2, 4, 8, 16]
    assert expert_parallel_sizes(QWEN3_MOE, ParallelDims(tp=2, pp=1, dp=6), "colocated") == [1, 2]
    assert expert_parallel_sizes(QWEN3_MOE, ParallelDims(tp=2, pp=2, dp=4), "colocated") == [1, 2, 4]
    assert expert_parallel_sizes(QWEN3_MOE, ParallelDims(tp=2, pp=1, dp=1, cp=4), "colocated") == [1, 2, 4]
    assert expert_parallel_sizes(QWEN3_MOE, ParallelDims(tp=1, pp=1, dp=8), "split-all") == [1, 2, 4, 8]
    dense = DecoderConfig.from_hf_dict(KNOWN["Qwen3-8B"])
    assert expert_parallel_sizes(dense, ParallelDims(tp=1, pp=1, dp=8), "colocated") == [1]


def test_an_ep_candidate_costs_the_dispatch_and_the_experts_gather():
    cfg = load_config("configs/qwen2.5-0.5b-grpo-gsm8k.yaml", ["model.path=models/Qwen3-30B-A3B"])
    planner = Planner(QWEN3_MOE, Workload.from_config(cfg), get_device("h100"))
    layout = ParallelDims(tp=2, pp=1, dp=8)
    wl, h100 = planner.wl, planner.device
    one, four = (roles.train_time(QWEN3_MOE, wl, layout, h100, 4, 1, ep=ep) for ep in (1, 4))
    assert "dispatch" not in one and four["dispatch"] > 0 and four["compute"] == one["compute"]
    assert four["dp"] < one["dp"]  # the experts' gradients reduce over dp / ep ranks
    assert planner.transition(layout, 2, 4)["experts"] == cost.gather_time(
        cost.expert_transition_bytes(QWEN3_MOE, 2, 4, 2), 4, 8, h100)
    assert "experts" not in planner.transition(layout, 2, 1)
    candidate = planner.colocated(16, layout, None, 2, ep=4)
    assert candidate.label().endswith("actor p1-t2-d8 ep4 tg2")
    assert candidate.memory["actor"]["weights"] == cost.rank_params(QWEN3_MOE, 2, ep=4) * 2


def test_qwen3_30b_a3b_on_16_h100s_prints_the_ep_it_picks_and_writes_a_config_that_loads(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert cli.main([*PLAN_30B, "--top", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("expert parallelism: ep "))
    ep = int(line.split()[3])
    cfg = load_config(out)  # every config check, validate_moe's included, accepts the written ep
    assert cfg.actor.parallel.ep == ep and f"ep {ep:3d}: " in text and "<- picked" in text
    assert "dry-run, actor" in text
    # why ep matters at all: without pipeline stages, only layouts that split the experts hold the model
    _, data = cli._load(cli.build_parser().parse_args(PLAN_30B))
    planner = Planner(QWEN3_MOE, Workload.from_config(data), get_device("h100"))
    flat = [c for c in planner.candidates(16, ("colocated",)) if c.actor.pp == 1 and c.actor.cp == 1]
    assert any(c.fits for c in flat) and all(c.ep > 1 for c in flat if c.fits)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dry_run_counts_what_megatron_core_builds_at_ep2(tmp_path):
    """The engine's GPTModel of a tiny Qwen3-MoE at dp2 x ep2 on 2 processes: each rank holds half the experts,
    the expert-data-parallel group is dp / ep = 1; the dry-run and the cost model count the same per rank."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    torchrun("tests/planner/ep_params_check.py", 2, tmp_path / "out.json", tmp_path / "config.json")
    got = json.loads((tmp_path / "out.json").read_text())
    cfg = DecoderConfig.from_pretrained(tmp_path)
    for ep in (1, 2):
        run = dry_run(cfg, ParallelDims(tp=1, pp=1, dp=2), 1, 4, divisible_by=16, ep=ep)
        for rank in got[f"ep{ep}"]:
            assert rank["params"] == run.exact_params[0] == run.model_params[0], ep
            assert rank["experts"] == cost.rank_expert_params(cfg, 1, 1, ep) == 3 * 32 * 24 * 4 * 2 // ep
            assert rank["expert_dp"] == 2 // ep
    assert got["ep1"][0]["params"] - got["ep2"][0]["params"] == 3 * 32 * 24 * 2 * 2
