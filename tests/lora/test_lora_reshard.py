"""`hybridflow reshard` of a LoRA actor's checkpoint (adapters only, `reshard/adapters.py`): to another layout and
back bit for bit, cut as the engine cuts them, and resumed at that layout."""
import json

import pytest
import torch

from hybridflow.checkpoint import shard_file
from hybridflow.cli import main
from tests.lora.test_lora_layouts import LORA_GRPO, one_process_run  # noqa: F401 (the module's fixture)
from tests.trainer.test_distributed_trainer import ROOT, run

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(400), pytest.mark.slow]


def reshard(*args) -> int:
    """The tool on the tiny configs' model (its config.json, its vocabulary padding)."""
    return main(["reshard", *map(str, args), "--config", str(ROOT / "hybridflow/assets/demo_model"),
                 "--make-vocab-size-divisible-by", "16", "--no-progress"])


def adapters(root, file=shard_file(0, 0)):
    (step,) = root.glob("step_*")
    return torch.load(step / "actor" / file, weights_only=True)["model"]


def test_lora_checkpoint_to_tp2_and_pp2_and_back_and_resumed_at_tp2(tmp_path, one_process_run):
    """The one-process run's step-2 adapters at tp2 (B of the column-parallel linears and A of the row-parallel
    ones halved, the other side whole) and at pp2, then back to tp1: every adapter bit for bit. trainer.json
    keeps the base model's record and names the new layout. Resumed at tp2 from the tp2 conversion and at tp1
    from the round trip (both with fresh Adam moments: a conversion leaves them behind), step 3 is the same
    (1e-5 relative, the learned metrics of two layouts, as tests/lora/test_lora_layouts.py holds them)."""
    from tests.trainer.test_trainer import learned

    step2 = one_process_run[0] / "tiny-grpo" / "checkpoints" / "step_000002"
    # The runs below resume from their output_dir/experiment/checkpoints: the conversions are written there.
    roots = {"t2": tmp_path / "run_t2" / "tiny-grpo" / "checkpoints", "p2": tmp_path / "p2",
             "t2_back": tmp_path / "run_t1" / "tiny-grpo" / "checkpoints", "p2_back": tmp_path / "p2_back"}
    assert reshard(step2, roots["t2"], "--to", "hybridflow", "--tp", 2) == 0
    assert reshard(step2, roots["p2"], "--to", "hybridflow", "--pp", 2) == 0
    want = torch.load(step2 / "actor" / shard_file(0, 0))["model"]
    for name in ("t2", "p2"):
        assert reshard(roots[name], roots[f"{name}_back"], "--to", "hybridflow") == 0
        back = adapters(roots[f"{name}_back"])
        assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want), name
    t2 = adapters(roots["t2"], shard_file(1, 0))
    qkv, proj = "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj"
    assert t2[f"{qkv}.lora_B"].shape[0] * 2 == want[f"{qkv}.lora_B"].shape[0]
    assert torch.equal(t2[f"{qkv}.lora_A"], want[f"{qkv}.lora_A"])
    assert t2[f"{proj}.lora_A"].shape[1] * 2 == want[f"{proj}.lora_A"].shape[1]
    p2 = adapters(roots["p2"], shard_file(0, 1))
    assert torch.equal(p2[f"{qkv}.lora_B"], want["decoder.layers.2.self_attention.linear_qkv.lora_B"])  # layer 2
    state = json.loads(next(roots["t2"].glob("step_*/trainer.json")).read_text())
    assert state["layouts"] == {"actor": "p1-t2-d1"} and state["base"] == json.loads(
        (step2 / "trainer.json").read_text())["base"]

    common = [*LORA_GRPO, "trainer.resume=auto"]
    _, at_tp2 = run("tiny-grpo.yaml", tmp_path / "run_t2", *common, "trainer.launcher=ray", "trainer.n_devices=2",
                    "actor.parallel.tp=2")
    _, at_tp1 = run("tiny-grpo.yaml", tmp_path / "run_t1", *common)
    for records in (at_tp1, at_tp2):  # resumed: only step 3 ran
        assert [r["step"] for r in records if r.get("step")] == [3], records
    one, two = learned(at_tp1), learned(at_tp2)
    for key, value in one[3].items():
        assert two[3][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_a_lora_checkpoint_converts_to_hybridflow_only(tmp_path, one_process_run, capsys):
    step2 = one_process_run[0] / "tiny-grpo" / "checkpoints" / "step_000002"
    assert reshard(step2, tmp_path / "hf", "--to", "hf") == 2 and not (tmp_path / "hf").exists()
    err = capsys.readouterr().err
    assert "error: --to: " in err and "is a LoRA checkpoint (adapters only): convert it to another layout" in err
