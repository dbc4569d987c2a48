"""A run started from the tool's checkpoint at TP2 x PP2 equals the run started from the HF model.

The tool converts the demo model into the checkpoint root of a run
(`trainer.output_dir/experiment/checkpoints`, step 0, the actor at p2-t2-d1);
the run resumes from it (`trainer.resume=auto`) on 4 Ray processes and its
GRPO step equals, metric for metric, those of a run that loads the HF
model itself at the same layout. The run's own checkpoint then converts to HF
equal to the trainer's export. (4 processes, ~40 s on 2 cores: slow.)
"""
import logging
from pathlib import Path

import pytest

from hybridflow.reshard.cli import main as reshard
from tests.reshard.conftest import assert_same_hf
from tests.trainer.test_distributed_trainer import run

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ["trainer.n_devices=4", "trainer.launcher=ray", "actor.parallel.tp=2", "actor.parallel.pp=2",
          "trainer.total_steps=1", "trainer.save_every=0", "data.val_files=[]", "trainer.val_before_train=false"]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(600)]


def test_run_from_converted_checkpoint_equals_run_from_hf(tmp_path, caplog):
    _, from_hf = run("tiny-grpo.yaml", tmp_path / "hf_run", *LAYOUT)
    checkpoints = tmp_path / "converted" / "tiny-grpo" / "checkpoints"
    assert reshard([str(ROOT / "hybridflow/assets/demo_model"), str(checkpoints), "--to", "hybridflow",
                    "--tp", "2", "--pp", "2", "--make-vocab-size-divisible-by", "16", "--no-progress"]) == 0
    with caplog.at_level(logging.INFO, logger="hybridflow.trainer.trainer"):
        summary, converted = run("tiny-grpo.yaml", tmp_path / "converted", *LAYOUT, "trainer.resume=auto")
    assert f"resumed from {checkpoints / 'step_000000'} (step 0)" in caplog.text  # the tool's shards were loaded
    steps = [m for m in from_hf if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1]
    other = [m for m in converted if "actor/pg_loss" in m]
    keys = [k for k in steps[0] if k.startswith(("actor/", "response", "reward", "score")) and "time" not in k]
    assert keys
    for a, b in zip(steps, other, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    # The other way: the run's own checkpoint (engine shards with Adam state, no config.json) out to HF equals
    # the trainer's HF export of the same weights, bit for bit.
    assert reshard([str(summary["checkpoint"]), str(tmp_path / "released"), "--to", "hf", "--config",
                    str(ROOT / "hybridflow/assets/demo_model"), "--verify", "--no-progress"]) == 0
    assert_same_hf(summary["hf_actor"], tmp_path / "released")
