"""The base model a LoRA checkpoint records (checkpoint/base.py): the same content at another path, split into
other files or upcast, has the same fingerprint; a base with one weight changed has another, and a resume onto it
is a ConfigError on model.path naming both paths."""
import shutil

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.checkpoint.base import base_record, check_base, fingerprint
from hybridflow.errors import ConfigError
from hybridflow.models.checkpoint import load_hf_state_dict
from tests.trainer.test_trainer import ROOT

DEMO = ROOT / "hybridflow" / "assets" / "demo_model"


def copy_of_demo(where, change=None, dtype=None, split=False, source=DEMO):
    """The demo model (or `source`) copied to `where`; `change(state)` edits its tensors, `dtype` recasts them,
    `split` writes them as two files with an index (as HF shards a large model)."""
    import json

    shutil.copytree(source, where)
    state = load_hf_state_dict(source, dtype)
    if change is not None:
        change(state)
    (where / "model.safetensors").unlink()
    if not split:
        save_file(state, str(where / "model.safetensors"))
        return where
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: state[n].contiguous() for n in part}, str(where / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (where / "model.safetensors.index.json").write_text(json.dumps(index))
    return where


def test_the_same_base_elsewhere_split_or_upcast_has_the_same_fingerprint(tmp_path):
    here = fingerprint(str(DEMO))
    assert fingerprint(str(copy_of_demo(tmp_path / "copy"))) == here
    assert fingerprint(str(copy_of_demo(tmp_path / "split", split=True))) == here
    bf16 = copy_of_demo(tmp_path / "bf16", dtype=torch.bfloat16)  # a bf16 base, and that base upcast exactly
    assert fingerprint(str(bf16)) != here
    assert fingerprint(str(copy_of_demo(tmp_path / "fp32", dtype=torch.float32, source=bf16))) == fingerprint(str(bf16))
    check_base(base_record(str(DEMO)), base_record(str(tmp_path / "copy")), "ckpt/step_000002")  # passes


def test_a_fine_tuned_base_is_refused_naming_the_key_and_both_paths(tmp_path):
    def nudge(state):  # one weight of one layer, as a fine-tune of a few layers changes them
        name = next(n for n in sorted(state) if n.endswith("layers.2.mlp.down_proj.weight"))
        state[name].mul_(1.01)

    other = copy_of_demo(tmp_path / "tuned", change=nudge)
    assert fingerprint(str(other)) != fingerprint(str(DEMO))
    with pytest.raises(ConfigError) as err:
        check_base(base_record(str(DEMO)), base_record(str(other)), "ckpt/step_000002")
    assert err.value.path == "model.path"
    assert str(DEMO) in str(err.value) and str(other) in str(err.value) and "ckpt/step_000002" in str(err.value)
    check_base(None, base_record(str(other)), "ckpt/step_000002")  # a step that recorded no base: nothing to check
