"""HF safetensors checkpoints: sharded index files and atomic writes."""
import json

import pytest
import torch

import hybridflow.models.checkpoint as ckpt
from hybridflow.models import load_decoder, load_hf_state_dict, save_decoder, save_hf_checkpoint


def _state(n: int = 6):
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(32, 16, generator=g) for i in range(n)}


def test_sharded_save_writes_an_index_and_loads_back(tmp_path):
    sd = _state()
    out = save_hf_checkpoint(sd, {"model_type": "llama"}, tmp_path / "ck", max_shard_bytes=5000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3 and shards[0] == "model-00001-of-00003.safetensors"
    assert index["metadata"]["total_size"] == 6 * 32 * 16 * 4
    loaded = load_hf_state_dict(out)
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_transformers_sharded_checkpoint_loads(tmp_path):
    from tests.models.conftest import build_hf_model

    model = build_hf_model("qwen2-bias-tied")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    dec = load_decoder(tmp_path)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(dec(ids), model(input_ids=ids).logits)


def test_index_naming_a_missing_shard_is_reported(tmp_path):
    out = save_hf_checkpoint(_state(), {}, tmp_path / "ck", max_shard_bytes=5000)
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        load_hf_state_dict(out)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "ck"
    save_hf_checkpoint(_state(2), {"version": 1}, target)
    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(tensors, filename, metadata=metadata)

    real_save = ckpt.save_file
    monkeypatch.setattr(ckpt, "save_file", failing_save)
    with pytest.raises(OSError, match="No space left"):
        save_hf_checkpoint(_state(6), {"version": 2}, target, max_shard_bytes=5000)
    assert json.loads((target / "config.json").read_text()) == {"version": 1}
    assert load_hf_state_dict(target).keys() == {"w0", "w1"}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary left behind


def test_overwrite_replaces_atomically(tmp_path, hf_checkpoint):
    _, path = hf_checkpoint
    dec = load_decoder(path)
    target = tmp_path / "export"
    save_decoder(dec, target)
    with torch.no_grad():
        dec.norm.weight.add_(1.0)
    save_decoder(dec, target)
    assert torch.equal(load_decoder(target).norm.weight, dec.norm.weight)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_directory_write_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    """common.write_dir_atomically (HF saves, the reshard tool): a failed write leaves the old directory as it
    was, even when it fails at the last rename, after the old one was moved aside; a good one replaces it."""
    import os

    from hybridflow.common import write_dir_atomically

    dst = tmp_path / "ckpt"
    write_dir_atomically(dst, lambda tmp: (tmp / "a").write_text("old"), "save")

    def broken(tmp):
        (tmp / "a").write_text("new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_dir_atomically(dst, broken, "save")
    assert (dst / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    real_replace, calls = os.replace, []

    def replace_failing_second(src, target):
        calls.append(src)
        if len(calls) == 2:  # the new directory into place, after the old one was moved aside
            raise OSError("rename failed")
        real_replace(src, target)

    monkeypatch.setattr(os, "replace", replace_failing_second)
    with pytest.raises(OSError, match="rename failed"):
        write_dir_atomically(dst, lambda tmp: (tmp / "a").write_text("new"), "save")
    monkeypatch.setattr(os, "replace", real_replace)
    assert (dst / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    write_dir_atomically(dst, lambda tmp: (tmp / "a").write_text("new"), "save")
    assert (dst / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
