"""Adapter-only weight syncs of a LoRA actor (issue 62 item 4): after the first sync the 3D-HybridEngine's
gather moves only the split side of each adapter, and the generation weights equal the merged route's."""
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import write_layout_model
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[2]


def adapter_plan_bytes(shapes, rank: int, element: int, tp: int, tg: int) -> int:
    """The formula of docs/design.md: at tp = t, tg, k = t / tg, a rank receives from its k - 1 gather peers
    their split side of each adapter, r * d_out / t elements (column-parallel, B's rows) or r * d_in / t
    (row-parallel, A's columns)."""
    k = tp // tg
    return sum((k - 1) * rank * (d_out if column else d_in) // tp * element for column, d_out, d_in in shapes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adapter_only_syncs_at_tp2_equal_the_merged_sync_bit_for_bit(tmp_path):
    """tp2 LoRA engine, generation at tg = 1 and tg = 2, adapters changed twice: each sync's generation weights
    equal the merged-tensor sync's exactly (and the logits at tg = 1); the first sync gathers the base (the
    merged sync's bytes and the adapters'), each later one only the adapters, its counted bytes equal to the
    plan's and to the formula, under 5% of the merged sync's."""
    model = write_layout_model(tmp_path / "model")
    torchrun("tests/lora/adapter_sync_check.py", 2, tmp_path / "syncs.pt", model)
    results = torch.load(tmp_path / "syncs.pt")
    for tg, out in results.items():
        formula = adapter_plan_bytes(out["shapes"], out["rank"], out["element"], 2, tg)
        assert len(out["shapes"]) == 8 and (formula > 0) == (tg == 1)
        first = out["first"]
        for sync in out["syncs"]:
            merged, adapters = sync["merged"], sync["adapters"]
            assert sync["equal"] and sync["changed"], tg
            if tg == 1:
                assert torch.equal(*sync["logits"])
            assert adapters["reshard/bytes_received"] == adapters["lora/adapter_bytes_received"] == formula
            assert adapters["lora/plan_bytes_received"] == formula
            assert first["reshard/bytes_received"] == merged["reshard/bytes_received"] + formula
            if tg == 1:
                assert merged["reshard/bytes_received"] > 0
                assert 0 < adapters["reshard/bytes_received"] < 0.05 * merged["reshard/bytes_received"]
            else:  # tg = t: every rank's generation shard is its training shard; nothing moves either way
                assert merged["reshard/bytes_received"] == adapters["reshard/bytes_received"] == 0


def demo_bridge(tp: int):
    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.config import DecoderConfig

    return get_bridge(DecoderConfig.from_pretrained(ROOT / "hybridflow" / "assets" / "demo_model"), 128, tp)


def adapter_formula_bytes(bridge, rank: int, element: int = 4) -> int:
    """docs/design.md's formula for a rollout rank apart: r * (d_in + d_out) elements per adapted matrix (every
    dense linear_qkv, linear_proj, linear_fc1, linear_fc2)."""
    shapes = bridge.megatron_shapes()
    names = [n for n in shapes if n.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                                              "linear_fc2.weight"))]
    return sum(rank * (shapes[n][0] + shapes[n][1]) * element for n in names)


def test_the_adapter_plan_sends_each_piece_from_a_rank_holding_it_and_r_times_d_in_plus_d_out_to_each_rollout_rank():
    """tp2 x dp2 into two rollout ranks: each rollout rank receives the formula's bytes; each split piece i is
    sent by a TP rank i of its stage, the replicated side once, and the four training ranks share the sending."""
    from hybridflow.hybrid_engine.lora_sync import adapted_matrices, plan_adapters
    from hybridflow.parallel.layout import Coord, ParallelDims

    bridge, train = demo_bridge(2), ParallelDims(tp=2, dp=2)
    matrices = adapted_matrices(bridge, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    plan = plan_adapters(matrices, 8, 4, train, bridge.cfg.num_layers, 2, 2**16)
    assert len(matrices) == 4 * bridge.cfg.num_layers
    assert [plan.bytes_received(4 + i) for i in range(2)] == [adapter_formula_bytes(bridge, 8)] * 2
    assert plan.needed_bytes == {0: adapter_formula_bytes(bridge, 8), 1: adapter_formula_bytes(bridge, 8)}
    sent = {b.src: 0 for b in plan.broadcasts}
    for b in plan.broadcasts:
        sent[b.src] += b.nbytes
        for s in b.slices:
            if s.param[-1].isdigit():  # a split piece: held by that TP rank only
                assert train.coord(b.src).tp == int(s.param.rsplit(".", 1)[1]), s.param
    assert len(sent) == 4 and max(sent.values()) < 1.1 * min(sent.values())
    # only the named dense linears are planned
    assert {m.weight.split(".")[-2] for m in adapted_matrices(bridge, ["linear_proj"])} == {"linear_proj"}


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(600)
def test_lora_grpo_with_the_rollout_apart_moves_the_adapters_only_after_the_first_sync(tmp_path):
    """A tp2 LoRA actor with its rollout on a process of its own (tg = 1): the first sync moves the base (the
    apart plan's bytes, the generation shard) and the adapters, every later one the adapters alone, each the
    plan's bytes and the formula's; three steps equal the one-process run within 1e-5 relative; after a last
    sync the rollout's weights are the merged HF export bit for bit."""
    from hybridflow.config.loader import load_config
    from hybridflow.models.checkpoint import load_hf_state_dict
    from hybridflow.trainer import read_metrics
    from hybridflow.trainer.trainer import RLTrainer
    from tests.lora.test_lora_layouts import LORA_GRPO
    from tests.trainer.test_distributed_trainer import compare_with_one_process, run
    from tests.trainer.test_trainer import in_repo

    apart = ["trainer.launcher=ray", "trainer.n_devices=3", "placement.training=[0,1]", "placement.reference=[0,1]",
             "placement.rollout=[2]", "actor.parallel.tp=2"]
    cfg = in_repo(load_config(ROOT / "configs" / "tiny-grpo.yaml",
                              [f"trainer.output_dir={tmp_path / 'apart'}", *apart, *LORA_GRPO]))
    trainer = RLTrainer(cfg)
    try:
        summary = trainer.fit()
        again = trainer.weights.sync.push()
        synced = trainer.separate_rollout.hf_weights()
    finally:
        trainer.shutdown()
    merged = load_hf_state_dict(summary["hf_actor"])
    assert synced.keys() == merged.keys() and all(torch.equal(synced[k], merged[k]) for k in merged)
    records = read_metrics(summary["run_dir"] / "metrics.jsonl")
    adapters = adapter_formula_bytes(demo_bridge(2), 8)
    full = records[1]["sync/formula_bytes_received"] - adapters
    for r in (*records[1:], again):
        assert r["sync/bytes_received"] == r["sync/plan_bytes_received"] == r["sync/formula_bytes_received"]
        assert r["sync/bytes_sent"] == r["sync/plan_bytes_sent"] > 0 and r["sync/collectives_off_plan"] == 0
        assert r["lora/adapter_bytes_received"] == adapters
    assert full > 10 * adapters  # the first sync: the whole generation shard besides
    assert [r["sync/bytes_received"] for r in (*records[2:], again)] == [adapters] * 3
    _, one = run("tiny-grpo.yaml", tmp_path / "one", *LORA_GRPO)
    compare_with_one_process("LoRA GRPO, rollout apart", records, one, steps=(1, 2, 3), rel=1e-5, abs_=1e-6)
