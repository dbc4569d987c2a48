"""One rule for the rows that stay off the driver (workers/driver_rows.py), held in-process as under Ray.

A driver-side stage that computes on a token tensor or a text must fail the same way whether the driver holds
the tensor (a local or torchrun run) or a placeholder for it (Ray's object store), so that the in-process
tests catch it."""
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.data import fields as F
from hybridflow.data.batch import Rows, RowsElsewhere, take_rows
from hybridflow.trainer.trainer import RLTrainer
from hybridflow.workers.driver_rows import DriverBatch, DriverFieldError, hand_on, off_driver
from tests.trainer.test_trainer import in_repo

ROOT = Path(__file__).resolve().parents[2]


def _batches() -> tuple[dict, dict]:
    """The same 4 rows as an in-process driver holds them and as a Ray driver does (token tensors and texts
    as placeholders sharing one `Rows`)."""
    here = {F.RESPONSE_MASK: torch.ones(4, 3), F.RESPONSE_TEXT: ["a", "b", "c", "d"],
            F.SCORES: torch.tensor([0.0, 1.0, 2.0, 3.0]), F.UID: ["0", "0", "1", "1"]}
    rows = Rows(("ref",), (4,), torch.arange(4, dtype=torch.int32))
    elsewhere = {**here, F.RESPONSE_MASK: RowsElsewhere(rows, F.RESPONSE_MASK),
                 F.RESPONSE_TEXT: RowsElsewhere(rows, F.RESPONSE_TEXT)}
    return here, elsewhere


@pytest.mark.parametrize("where", ["in-process", "ray"])
def test_a_driver_stage_reading_token_rows_fails_alike_in_process_and_under_ray(where):
    batch = DriverBatch(_batches()[where == "ray"])
    assert torch.equal(batch[F.SCORES], torch.tensor([0.0, 1.0, 2.0, 3.0]))  # one number a row: read here
    for name in (F.RESPONSE_MASK, F.RESPONSE_TEXT):
        assert off_driver(name, dict.__getitem__(batch, name))
        with pytest.raises(DriverFieldError, match=f"read '{name}'"):
            batch[name]
        with pytest.raises(DriverFieldError):
            batch.get(name)
    # Cutting rows and handing fields on to a worker are not reads.
    kept = take_rows(batch, torch.tensor([True, False, True, False]))
    assert len(kept[F.RESPONSE_MASK]) == 2 and kept[F.UID] == ["0", "1"]
    assert set(hand_on(batch, (F.RESPONSE_TEXT, F.SCORES))) == {F.RESPONSE_TEXT, F.SCORES}


def _stage_reading_tokens(batch, metrics):
    metrics["tokens"] = batch[F.RESPONSE_MASK].sum().item()
    return batch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_the_trainer_holds_its_stages_to_the_rule_in_process_and_under_ray(tmp_path, request, launcher):
    """A whole-batch stage added to the trainer that computes on RESPONSE_MASK fails with the same error
    whichever launcher runs the groups; the batch `prepare` returns is a plain dict again."""
    devices = []
    if launcher == "ray":
        request.getfixturevalue("ray_cluster")
        devices = ["trainer.n_devices=2"]
    cfg = in_repo(load_config(ROOT / "configs" / "tiny-grpo.yaml", [
        f"trainer.output_dir={tmp_path}", f"trainer.launcher={launcher}", *devices, "data.val_files=[]"]))
    trainer = RLTrainer(cfg)
    try:
        trainer.batch_stages.append(_stage_reading_tokens)
        with pytest.raises(DriverFieldError, match=f"read '{F.RESPONSE_MASK}'"):
            trainer.prepare(1)
        trainer.batch_stages.pop()
        batch, _, _ = trainer.prepare(1)
        assert type(batch) is dict and F.ADVANTAGES in batch
    finally:
        trainer.shutdown()
