"""hybridflow.checkpoint: CheckpointManager (atomic step directories, latest marker, pruning, failed and crashed
saves), the atomic file writes it uses, and the checks a resume makes (models, layouts)."""
import json
import os

import pytest
import torch

from hybridflow.checkpoint import CheckpointError, CheckpointManager
from hybridflow.common import atomic_torch_save, atomic_write_json

DEAD_PID = 4_194_304 + 12_345  # above Linux's largest pid_max: never a live process


def _writer(tag: str):
    def write(d):
        (d / "model.bin").write_bytes(tag.encode() * 100)
        (d / "sub").mkdir()
        atomic_write_json(d / "sub" / "meta.json", {"tag": tag})
    return write


def _hidden(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_save_publishes_a_complete_directory_and_marker(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=0)
    assert mgr.latest() is None and mgr.all_steps() == []
    seen = []

    def write(d):
        seen.append(d)
        assert d.parent == mgr.root and d.name.startswith(".tmp-step_000010-")
        _writer("a")(d)

    path = mgr.save(10, write)
    assert path == mgr.root / "step_000010" and not seen[0].exists()
    assert json.loads((path / "sub" / "meta.json").read_text()) == {"tag": "a"}
    assert (mgr.root / "latest").read_text().strip() == "step_000010"
    assert mgr.latest() == (10, path)
    assert _hidden(mgr.root) == []


def test_saving_a_step_again_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(3, _writer("old"))
    path = mgr.save(3, _writer("new"))
    assert json.loads((path / "sub" / "meta.json").read_text()) == {"tag": "new"}
    assert mgr.all_steps() == [3] and _hidden(tmp_path) == []


def test_keep_last_prunes_the_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (5, 10, 15, 20):
        mgr.save(step, _writer(str(step)))
    assert mgr.all_steps() == [15, 20] and mgr.latest()[0] == 20
    keep_all = CheckpointManager(tmp_path, keep_last=0)
    keep_all.save(25, _writer("x"))
    assert keep_all.all_steps() == [15, 20, 25]


def test_an_interrupted_prune_leaves_no_half_deleted_step(tmp_path, monkeypatch):
    """#13: Ctrl-C in the middle of pruning left three step directories at keep_last=2 (one half
    deleted). A doomed step is renamed away first, so whatever the delete leaves is not a step, and
    the next manager clears it once this process is gone."""
    import shutil

    from hybridflow.checkpoint import manager

    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2):
        mgr.save(step, _writer(str(step)))
    real_rmtree = shutil.rmtree

    def interrupted(path, *args, **kwargs):
        if ".pruned-" in str(path) or "step_000001" in str(path):
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(manager.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(3, _writer("3"))
    monkeypatch.undo()
    assert mgr.all_steps() == [2, 3] and mgr.latest()[0] == 3
    leftover = [p for p in tmp_path.iterdir() if p.name.startswith(".pruned-step_000001-")]
    assert len(leftover) == 1
    leftover[0].rename(tmp_path / f".pruned-step_000001-{DEAD_PID}")  # as if this process had died
    CheckpointManager(tmp_path, keep_last=2)
    assert _hidden(tmp_path) == [] and mgr.all_steps() == [2, 3]


@pytest.mark.parametrize("keep_last, kept", [(2, [10, 12]), (0, [10, 12, 20])])
def test_a_resumed_run_follows_the_marker_and_prunes_the_abandoned_steps(tmp_path, keep_last,
                                                                          kept):
    # Step 20 was published but the crash came before its marker: resume from 10.
    mgr = CheckpointManager(tmp_path, keep_last=keep_last)
    mgr.save(10, _writer("a"))
    mgr.save(20, _writer("abandoned"))
    (tmp_path / "latest").write_text("step_000010\n")
    assert mgr.latest()[0] == 10
    mgr.save(12, _writer("resumed"))
    assert mgr.all_steps() == kept and mgr.latest()[0] == 12


def test_failed_write_keeps_the_previous_checkpoint_and_removes_tmp(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    good = mgr.save(10, _writer("good"))

    def write(d):
        (d / "shard_0.bin").write_bytes(b"x" * 1000)  # part-way through
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="step 20") as err:
        mgr.save(20, write)
    assert isinstance(err.value, OSError) and "No space left" in str(err.value)
    assert err.value.step == 20 and err.value.__cause__.errno == 28
    assert mgr.latest() == (10, good) and mgr.all_steps() == [10]
    assert (tmp_path / "latest").read_text().strip() == "step_000010"
    assert json.loads((good / "sub" / "meta.json").read_text()) == {"tag": "good"}
    assert _hidden(tmp_path) == []


def test_stale_tmp_dirs_and_markers_are_ignored_then_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(10, _writer("a"))
    # A save of step 30 that crashed mid-write, and one by a live process.
    crashed = tmp_path / f".tmp-step_000030-{DEAD_PID}"
    live = tmp_path / f".tmp-step_000040-{os.getpid()}"
    for d in (crashed, live):
        d.mkdir()
        (d / "model.bin").write_bytes(b"partial")
    assert mgr.latest()[0] == 10 and mgr.all_steps() == [10]
    # A marker naming a step that was deleted by hand falls back to the newest directory.
    (tmp_path / "latest").write_text("step_000099\n")
    assert mgr.latest() == (10, tmp_path / "step_000010")
    (tmp_path / "latest").write_text("garbage")
    assert mgr.latest()[0] == 10
    (tmp_path / "latest").unlink()
    assert mgr.latest()[0] == 10
    CheckpointManager(tmp_path, keep_last=0)  # a restarted run cleans up dead saves only
    assert not crashed.exists() and live.exists()


def test_crash_between_renames_restores_the_old_directory(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(10, _writer("a"))
    os.rename(tmp_path / "step_000010", tmp_path / f".old-step_000010-{DEAD_PID}")
    mgr = CheckpointManager(tmp_path, keep_last=0)
    assert mgr.latest() == (10, tmp_path / "step_000010")
    assert _hidden(tmp_path) == []


def test_atomic_file_helpers(tmp_path):
    atomic_write_json(tmp_path / "state.json", {"step": 3, "seed": [1, 2]})
    atomic_write_json(tmp_path / "state.json", {"step": 4})
    assert json.loads((tmp_path / "state.json").read_text()) == {"step": 4}
    state = {"rng": torch.get_rng_state(), "x": torch.arange(4)}
    atomic_torch_save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt")
    assert torch.equal(loaded["x"], state["x"])
    with pytest.raises(TypeError):  # not JSON-serialisable: the old file stays, no tmp left
        atomic_write_json(tmp_path / "state.json", {"bad": object()})
    assert json.loads((tmp_path / "state.json").read_text()) == {"step": 4}
    with pytest.raises(Exception):  # pickling fails part-way through the file
        atomic_torch_save({"x": torch.zeros(1000), "f": lambda: 0}, tmp_path / "rng.pt")
    assert torch.equal(torch.load(tmp_path / "rng.pt")["x"], state["x"])
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("damage, why", [
    (lambda d: (d / "model.bin").unlink(), "model.bin is missing"),
    (lambda d: (d / "model.bin").write_bytes(b"cut"), "model.bin has 3 bytes, 100 were saved"),
    (lambda d: (d / "sub" / "meta.json").unlink(), "sub/meta.json is missing"),
    (lambda d: (d / "manifest.json").write_bytes(b"\xff{"), "its manifest.json is unreadable"),
    (lambda d: (d / "sub" / "meta.json").write_text((d / "sub" / "meta.json").read_text().replace('"b"', '"c"')),
     "sub/meta.json is not the file that was saved (same size, other content)"),
])
def test_resume_falls_back_past_a_damaged_step_and_names_it(tmp_path, caplog, damage, why):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(10, _writer("a"))
    newest = mgr.save(20, _writer("b"))
    damage(newest)
    with caplog.at_level("WARNING"):
        assert mgr.latest() == (10, tmp_path / "step_000010")
    assert f"skipping checkpoint {newest}: {why}" in caplog.text


def test_an_emptied_step_and_a_binary_marker_fall_back_too(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(10, _writer("a"))
    mgr.save(20, _writer("b"))
    (tmp_path / "step_000030").mkdir()  # an empty step directory, newest of all
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00step")  # not UTF-8: used to raise UnicodeDecodeError
    with caplog.at_level("WARNING"):
        assert mgr.latest()[0] == 20
    assert "step_000030: it is empty" in caplog.text
    for name in ("step_000020", "step_000010"):
        for f in (tmp_path / name).iterdir():
            if f.is_file():
                f.write_bytes(b"")
    assert mgr.latest() is None  # nothing intact is left
    with pytest.raises(CheckpointError, match=r"no intact checkpoint under .* \(step_000010: its manifest.json is "
                                              r"unreadable; step_000020: .*; step_000030: it is empty\)"):
        mgr.resume_point()  # a resume does not quietly start over (that would prune these steps)
    assert CheckpointManager(tmp_path / "new", keep_last=0).resume_point() is None  # never saved: start


def test_a_model_of_another_shape_is_named_by_its_first_differing_tensor(tmp_path):
    """check_models compares the tensor tables a step was saved with (trainer.json's "models") with this
    run's: the first difference, in the checkpoint's order, names the tensor and both shapes."""
    import dataclasses

    from hybridflow.config.loader import load_config
    from hybridflow.config.plan import RunPlan
    from hybridflow.models.config import DecoderConfig
    from hybridflow.trainer.build import model_tensors
    from hybridflow.checkpoint.format import check_models

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "configs/tiny-ppo.yaml"))
    plan = RunPlan.from_config(cfg)
    demo = DecoderConfig.from_pretrained(os.path.join(root, "hybridflow/assets/demo_model"))  # 4 layers
    saved = model_tensors(cfg, plan, demo)
    assert set(saved) == {"actor", "critic"} and saved["critic"]["output_layer.weight"] == [1, 128]
    paths = {"actor": "/m/three", "critic": "/m/three"}

    def refused(**change) -> str:
        here = model_tensors(cfg, plan, dataclasses.replace(demo, layer_windows=[], **change))
        with pytest.raises(CheckpointError) as err:
            check_models(saved, here, tmp_path / "step_000004", 4, paths)
        assert err.value.step == 4 and "\n" not in str(err.value)
        return str(err.value)

    check_models(saved, model_tensors(cfg, plan, demo), tmp_path, 4, paths)  # the same model: nothing to say
    check_models(None, {}, tmp_path, 4, paths)  # saved before the tables were recorded: nothing to check
    line = refused(num_layers=3)
    assert line.startswith(f"trainer.resume=auto: {tmp_path}/step_000004: its actor does not fit this run's model "
                           "/m/three: decoder.layers.3.input_layernorm.weight [128] is in the checkpoint and not in "
                           "this model;")
    assert "decoder.layers.0.mlp.linear_fc1.weight is [768, 128] in the checkpoint and [512, 128] in this " \
           "model" in refused(intermediate_size=256)
    assert "decoder.layers.4.input_layernorm.weight [128] is in this model and not in the checkpoint" in \
        refused(num_layers=5)
    with pytest.raises(CheckpointError, match=r"step_000004 holds no critic \(its run had none\)"):
        check_models({"actor": saved["actor"]}, saved, tmp_path / "step_000004", 4, paths)
    with pytest.raises(CheckpointError, match=r"trainer.json: its 'models' entry is not a table"):
        check_models(["x"], saved, tmp_path, 4, paths)


def test_too_little_free_space_is_a_full_disk_before_anything_is_written(tmp_path, monkeypatch):
    """The free space is checked against the newest step's size (or the caller's floor, if larger) first."""
    import errno
    import shutil
    from collections import namedtuple

    mgr = CheckpointManager(tmp_path, keep_last=2)
    good = mgr.save(10, _writer("good"))
    size = sum(p.stat().st_size for p in good.rglob("*") if p.is_file())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - size + 1, size - 1))
    written = []
    with pytest.raises(CheckpointError) as err:
        mgr.save(20, written.append)
    assert written == [] and err.value.errno == errno.ENOSPC and err.value.step == 20
    assert str(err.value) == (f"checkpoint step 20 was not saved: No space left on device (it needs about {size:,} "
                              f"bytes, {size - 1:,} bytes are free; nothing was written, earlier checkpoints are "
                              f"untouched): {tmp_path}/step_000020")
    assert mgr.latest() == (10, good) and _hidden(tmp_path) == []
    with pytest.raises(CheckpointError, match=r"it needs about 2.0 MiB, [\d,]+ bytes are free"):
        CheckpointManager(tmp_path / "first", keep_last=2).save(1, _writer("a"), expected_bytes=2 << 20)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - size, size))
    assert mgr.save(20, _writer("fits")) == tmp_path / "step_000020"  # exactly enough is enough


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4992 vs 4880"),  # torch.save's zip
    OSError(28, "No space left on device"),
    OSError(122, "Disk quota exceeded"),
], ids=["torch zip writer", "ENOSPC", "EDQUOT"])
def test_a_writer_running_out_of_space_is_a_full_disk_naming_the_step(tmp_path, error):
    import errno

    mgr = CheckpointManager(tmp_path, keep_last=1)
    good = mgr.save(10, _writer("good"))

    def write(d):
        (d / "shard_0.bin").write_bytes(b"x" * 1000)  # part-way through
        raise error

    with pytest.raises(CheckpointError) as err:
        mgr.save(20, write)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "step_000020")
    assert str(err.value).startswith("checkpoint step 20 was not saved: No space left on device (")
    assert str(error).splitlines()[0] in str(err.value) and str(err.value).endswith(str(tmp_path / "step_000020"))
    assert err.value.__cause__ is error
    assert mgr.latest() == (10, good) and mgr.all_steps() == [10] and _hidden(tmp_path) == []


def test_other_write_errors_stay_what_they_are(tmp_path):
    def write(d):
        raise RuntimeError("the worker died")

    with pytest.raises(CheckpointError) as err:
        CheckpointManager(tmp_path, keep_last=1).save(3, write)
    assert err.value.errno is None
    assert str(err.value) == f"checkpoint step 3 was not saved to {tmp_path}/step_000003: RuntimeError: the worker died"


def test_a_resume_at_another_layout_is_named_as_one(tmp_path):
    """The model tables describe the model whatever the layout (a vocabulary padded for TP 2 is the same
    model); the layout each checkpoint's shards were written at is checked on its own, in one line."""
    from hybridflow.config.loader import load_config
    from hybridflow.config.plan import RunPlan
    from hybridflow.models.config import DecoderConfig
    from hybridflow.trainer.build import checkpoint_layouts, model_tensors
    from hybridflow.checkpoint.format import check_layouts

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    demo = DecoderConfig.from_pretrained(os.path.join(root, "hybridflow/assets/demo_model"))
    plans = {tp: RunPlan.from_config(load_config(os.path.join(root, "configs/tiny-ppo.yaml"), [
        "trainer.n_devices=2", "trainer.launcher=ray", f"actor.parallel.tp={tp}", f"critic.parallel.tp={tp}"]))
        for tp in (1, 2)}
    cfg = load_config(os.path.join(root, "configs/tiny-ppo.yaml"))
    assert model_tensors(cfg, plans[1], demo) == model_tensors(cfg, plans[2], demo)
    saved, here = checkpoint_layouts(plans[1], cfg), checkpoint_layouts(plans[2], cfg)
    assert saved == {"actor": "p1-t1-d2", "critic": "p1-t1-d2"}
    check_layouts(saved, saved, tmp_path, 3)
    check_layouts(None, here, tmp_path, 3)  # saved before layouts were recorded: nothing to check
    with pytest.raises(CheckpointError) as err:
        check_layouts(saved, here, tmp_path / "step_000003", 3)
    assert str(err.value).startswith(f"trainer.resume=auto: {tmp_path}/step_000003: its actor was saved at layout "
                                     "p1-t1-d2 (its shards per rank) and this run trains it at p1-t2-d1")


def test_a_resume_at_another_virtual_pp_is_refused(tmp_path):
    """Shards at virtual_pp 2 name each model chunk's tensors, so the layout records it ("-v2") and a run at
    the same pp without it (or the other way round) is refused before a shard is read."""
    from hybridflow.config.loader import load_config
    from hybridflow.config.plan import RunPlan
    from hybridflow.trainer.build import checkpoint_layouts
    from hybridflow.checkpoint.format import check_layouts

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    layouts = {}
    for extra in ([], ["actor.parallel.virtual_pp=2"]):
        cfg = load_config(os.path.join(root, "configs/tiny-grpo.yaml"),
                          ["trainer.n_devices=2", "trainer.launcher=ray", "actor.parallel.pp=2", *extra])
        layouts[len(extra)] = checkpoint_layouts(RunPlan.from_config(cfg), cfg)
    assert layouts == {0: {"actor": "p2-t1-d1"}, 1: {"actor": "p2-t1-d1-v2"}}
    with pytest.raises(CheckpointError, match="saved at layout p2-t1-d1-v2 .* this run trains it at p2-t1-d1;"):
        check_layouts(layouts[1], layouts[0], tmp_path, 3)
