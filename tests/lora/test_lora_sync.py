"""Adapter-only weight syncs of a LoRA actor (issue 62 item 4): after the first sync the 3D-HybridEngine's
gather moves only the split side of each adapter, and the generation weights equal the merged route's."""
import pytest
import torch

from tests.engine.conftest import write_layout_model
from tests.torchrun import torchrun


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
