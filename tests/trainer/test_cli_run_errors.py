"""Bad input to `hybridflow` that needs a finished run first ends in one stderr line too: a resume from a
damaged checkpoint, or with a model of another shape; starting afresh over a previous run; a full disk; and
`--debug`, which shows the traceback instead (the tables of the rest are in test_cli_errors.py)."""
import errno
import os
import shutil
from pathlib import Path

import pytest

from hybridflow.cli import main
from tests.trainer.test_cli_errors import (ROOT, TRAIN, _assert_line, _config_json, _model,  # noqa: F401
                                           _one_line, repo)


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    """The run directory of a finished 1-step run (checkpoint step_000001), to resume from."""
    out = tmp_path_factory.mktemp("previous")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        assert main([*TRAIN, f"trainer.output_dir={out}"]) == 0
    return out


def _same_size(text: str):
    """Overwrite trainer.json with `text` padded to its size: the manifest's size check passes."""
    def edit(step: Path):
        size = (step / "trainer.json").stat().st_size
        (step / "trainer.json").write_text(text.ljust(size))
    return edit


RESUME = {  # name -> (damage to the saved step directory, the line's text; {c} is the checkpoints directory)
    "trainer.json not JSON": (_same_size("not json"), "no intact checkpoint under {c} (step_000001: trainer.json is "
                                                      "not the file that was saved (same size, other content))"),
    "trainer.json without kl_coef": (_same_size('{"step": 1}'), "(step_000001: trainer.json is not the file that "
                                                                "was saved (same size, other content))"),
    "trainer.json emptied": (lambda step: (step / "trainer.json").write_text(""),
                             "(step_000001: trainer.json has 0 bytes, "),
    "manifest not JSON": (lambda step: (step / "manifest.json").write_text("{"),
                          "(step_000001: its manifest.json is unreadable)"),
    # A step saved before manifests existed is taken as it is: trainer.json is then checked when read.
    "no manifest, trainer.json not JSON": (
        lambda step: ((step / "manifest.json").unlink(), (step / "trainer.json").write_text("not json")),
        "trainer.resume=auto: {c}/step_000001/trainer.json is not a trainer state this run can resume from "
        "(JSONDecodeError"),
    "no manifest, trainer.json without kl_coef": (
        lambda step: ((step / "manifest.json").unlink(), (step / "trainer.json").write_text('{"step": 1}')),
        "{c}/step_000001/trainer.json is not a trainer state this run can resume from (KeyError: 'kl_coef')"),
}


@pytest.mark.parametrize("case", list(RESUME))
def test_resume_from_a_damaged_checkpoint_gets_one_line(case, previous_run, tmp_path, capsys, repo):
    damage, text = RESUME[case]
    shutil.copytree(previous_run, tmp_path, dirs_exist_ok=True)
    checkpoints = tmp_path / "tiny-grpo" / "checkpoints"
    damage(checkpoints / "step_000001")
    argv = [*TRAIN, "trainer.total_steps=2", "trainer.resume=auto", f"trainer.output_dir={tmp_path}"]
    _assert_line(_one_line(argv, capsys), 1, text.format(c=checkpoints))


def test_starting_afresh_over_a_previous_run_gets_one_line(previous_run, tmp_path, capsys, repo):
    shutil.copytree(previous_run, tmp_path, dirs_exist_ok=True)
    _assert_line(_one_line([*TRAIN, f"trainer.output_dir={tmp_path}"], capsys), 2,
                 f"trainer.resume: {tmp_path}/tiny-grpo holds a previous run (metrics.jsonl")


def _disk_full(obj, path, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _zip_writer_full(obj, path, *args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4992 vs 4880")


@pytest.mark.parametrize("writer", ["metrics", "checkpoint shard", "checkpoint shard, torch's words", "HF export"])
def test_a_full_disk_gets_one_line_naming_the_directory(writer, tmp_path, capsys, repo, monkeypatch):
    """Each writer of a run meets ENOSPC in a 1-step run; the line says so and names the run directory. torch's
    zip writer says only "unexpected pos" when the disk fills under it: that too is named a full disk."""
    import torch

    import hybridflow.models.checkpoint

    run = tmp_path / "tiny-grpo"
    if writer == "metrics":  # a real ENOSPC, from the kernel: every write to /dev/full fails so
        if not Path("/dev/full").exists():
            pytest.skip("no /dev/full on this system")
        run.mkdir()
        (run / "metrics.jsonl").symlink_to("/dev/full")
    elif writer == "checkpoint shard":  # each engine writes its shard with torch.save(state, path)
        monkeypatch.setattr(torch, "save", _disk_full)
    elif writer == "checkpoint shard, torch's words":
        monkeypatch.setattr(torch, "save", _zip_writer_full)
    else:  # the HF export writes safetensors
        monkeypatch.setattr(hybridflow.models.checkpoint, "save_file", _disk_full)
    code, line = _one_line([*TRAIN, f"trainer.output_dir={tmp_path}"], capsys)
    assert code == 1 and "No space left on device" in line and str(run) in line, line


def test_debug_shows_the_traceback_instead_of_the_line(tmp_path, capsys, repo):
    """#13 item 7: the full traceback on request (`hybridflow --debug`), for user errors and the rest."""
    from hybridflow.errors import ConfigError

    with pytest.raises(ConfigError, match="actor.optim.lr: must be a finite number"):
        main(["--debug", *TRAIN, f"trainer.output_dir={tmp_path}", "actor.optim.lr=-1"])
    assert main([*TRAIN, f"trainer.output_dir={tmp_path}", "actor.optim.lr=-1"]) == 2
    assert "hybridflow: error: actor.optim.lr" in capsys.readouterr().err


def _fewer_layers(d: Path):
    """The demo model (4 layers) cut to its first 3."""
    from safetensors.torch import load_file, save_file

    _config_json(num_hidden_layers=3)(d)
    weights = load_file(d / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers.3." not in k}, d / "model.safetensors")


def test_resuming_with_a_model_of_another_shape_gets_one_line(previous_run, tmp_path, capsys, repo, monkeypatch):
    """It ended in `KeyError: 'decoder.layers.3.input_layernorm.weight'` from a worker's load, with a traceback.
    The controller now compares the tensors the step was saved with against this run's model first."""
    from hybridflow.engine.megatron import MegatronEngine

    def load(*_):
        raise AssertionError("a worker read a shard before the model was checked")

    monkeypatch.setattr(MegatronEngine, "load", load)
    shutil.copytree(previous_run, tmp_path / "out")
    model = _model(tmp_path, "three_layers", _fewer_layers)
    argv = [*TRAIN, "trainer.total_steps=2", "trainer.resume=auto", f"trainer.output_dir={tmp_path / 'out'}",
            f"model.path={model}"]
    step = tmp_path / "out" / "tiny-grpo" / "checkpoints" / "step_000001"
    _assert_line(_one_line(argv, capsys), 1, f"trainer.resume=auto: {step}: its actor does not fit this run's model "
                                             f"{model}: decoder.layers.3.input_layernorm.weight [128] is in the "
                                             "checkpoint and not in this model; resume with the model it was saved "
                                             "with, or start over")
