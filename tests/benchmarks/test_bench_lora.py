"""`hybridflow bench lora`: a rank's trained state, the sync bytes and the step time, full fine-tuning vs LoRA."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_lora  # noqa: E402

DEMO = str(Path(__file__).resolve().parents[2] / "hybridflow" / "assets" / "demo_model")


@pytest.mark.timeout(400)
def test_lora_trains_adapters_only_holds_no_reference_and_syncs_its_adapters_after_the_first(tmp_path):
    """Counted, not timed, on the small demo model at r = 2 and 8: LoRA's gradients and Adam moments are those
    of its adapters alone (r * (d_in + d_out) per adapted matrix) and it holds no reference, while full
    fine-tuning's cover every parameter and hold a reference as large as the model; a later sync moves the
    adapters alone (the formula), the first the base besides; counted at tp 2 -> tg 1, later syncs move the
    plan's bytes; the Qwen2.5-7B projection keeps LoRA r = 8's trained state under 0.1x full's."""
    bench_lora.main(["--model", DEMO, "--ranks", "2,8", "--steps", "1", "--rows", "2", "--seq", "16",
                     "--json", str(tmp_path / "lora.json")])
    out = json.loads((tmp_path / "lora.json").read_text())
    full, *loras = out["memory"]
    assert full["rank"] == 0 and full["trained_param_bytes"] == full["param_bytes"] == full["reference_bytes"]
    assert full["grad_bytes"] == full["param_bytes"] and full["optimizer_bytes"] == 2 * full["param_bytes"]
    for row, sync in zip(loras, out["syncs"]):
        adapters = sync["formula"]  # float32: bytes of every adapter
        assert row["trained_param_bytes"] == row["grad_bytes"] == adapters
        assert row["optimizer_bytes"] == 2 * adapters and row["reference_bytes"] == 0
        assert row["param_bytes"] == full["param_bytes"] + adapters
        assert sync["later"] == adapters and sync["first"] == sync["full"] + adapters
        assert row["trained_ratio"] == pytest.approx(adapters / full["param_bytes"])
    assert loras[0]["trained_ratio"] < loras[1]["trained_ratio"] < 1
    for c in out["counted_syncs"]:
        assert c["later"] == c["plan"] > 0 and c["first"] == c["full"] + c["plan"] and c["later"] < c["full"]
    projected = {row["rank"]: row for row in out["projected"]}
    assert projected[8]["trained_ratio"] <= 0.1 and projected[0]["reference_bytes"] > 0 == projected[8]["reference_bytes"]
