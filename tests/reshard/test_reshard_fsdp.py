"""FSDP checkpoints (torch DCP, engine/fsdp.py) through the reshard tool: read bit-exact, written loadable.

The checkpoints are what FSDPEngine saved at 2 ranks after one optimizer step, in the session's two-process
launch (tests/reshard/fsdp_save_check.py), with what the engines held gathered beside them; the tool's
conversions are the same bytes moved, so every comparison is `torch.equal`.
"""
import json
import shutil

import pytest
import torch

from hybridflow.checkpoint import shard_file
from hybridflow.cli import main as hybridflow_main
from hybridflow.errors import ConfigError
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import load_hf_state_dict
from hybridflow.models.config import DecoderConfig
from hybridflow.reshard.cli import main as reshard_main

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def saved(two_process_launch):
    base = two_process_launch["fsdp_reshard"]
    return base, torch.load(base / "weights.pt", weights_only=True)


def reshard(*args) -> int:
    return hybridflow_main(["reshard", *map(str, args), "--no-progress"])


def assert_equal_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_an_fsdp_actor_converts_to_hf_bit_exact_from_its_root_step_and_directory(saved, tmp_path):
    base, weights = saved
    root = base / "checkpoints"
    meta = json.loads((root / "step_000001" / "actor" / "engine.json").read_text())
    assert meta["world"] == 2 and meta["optimizer"]  # Adam's state is in the checkpoint, and left unread
    for name, src in (("root", root), ("step", root / "step_000001"), ("dir", root / "step_000001" / "actor")):
        assert reshard(src, tmp_path / name, "--to", "hf", "--config", base / "hf", "--verify") == 0
        assert_equal_tensors(load_hf_state_dict(tmp_path / name), weights["actor_hf"])
    hf = load_hf_state_dict(base / "hf")  # the step moved every tensor: the output is not the start
    assert not any(torch.equal(hf[n], weights["actor_hf"][n]) for n in hf if n.endswith("proj.weight"))


def test_an_fsdp_actor_to_hybridflow_tp2_pp2_and_on_to_hf_is_bit_exact(saved, tmp_path):
    base, weights = saved
    step = base / "checkpoints" / "step_000001"
    assert reshard(step, tmp_path / "t2p2", "--to", "hybridflow", "--tp", 2, "--pp", 2, "--config", base / "hf",
                   "--verify") == 0
    out = tmp_path / "t2p2" / "step_000001"  # the run's step and trainer.json carried on
    assert sorted(p.name for p in (out / "actor").glob("*.pt")) == sorted(
        shard_file(r, s) for r in range(2) for s in range(2))
    state = json.loads((out / "trainer.json").read_text())
    assert state["step"] == 1 and state["kl_coef"] == 0.05 and state["layouts"] == {"actor": "p2-t2-d1"}
    assert reshard(tmp_path / "t2p2", tmp_path / "hf", "--to", "hf", "--verify") == 0
    assert_equal_tensors(load_hf_state_dict(tmp_path / "hf"), weights["actor_hf"])


def test_an_fsdp_critic_converts_to_a_token_classifier_bit_exact(saved, tmp_path):
    base, weights = saved
    step = base / "checkpoints" / "step_000001"
    assert reshard(step, tmp_path / "hf", "--to", "hf", "--role", "critic", "--config", base / "hf",
                   "--verify") == 0
    cfg = DecoderConfig.from_pretrained(base / "hf")
    bridge = get_bridge(cfg)
    want = {"score.weight": weights["critic_head"]}
    for e in bridge.entries():
        if e.generation != "lm_head.weight":
            want.update(zip(e.hf, bridge.split_parts(e, weights["critic_generation"][e.generation])))
    assert weights["critic_head"].abs().sum() > 0  # the head moved off its zero start
    assert_equal_tensors(load_hf_state_dict(tmp_path / "hf"), want)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and config["num_labels"] == 1


def test_a_megatron_role_beside_an_fsdp_one_is_read_as_hybridflow(saved, tmp_path):
    """A step with the actor under FSDP and the critic under megatron-core: --role picks the reader."""
    base, weights = saved
    step = tmp_path / "mixed" / "step_000001"
    shutil.copytree(base / "checkpoints" / "step_000001" / "actor", step / "actor")
    reshard_main([str(base / "hf"), str(tmp_path / "critic"), "--to", "hybridflow", "--tp", "2", "--role", "critic",
                  "--no-progress"])
    shutil.copytree(tmp_path / "critic" / "step_000000" / "critic", step / "critic")
    assert reshard(step, tmp_path / "a", "--to", "hf", "--config", base / "hf") == 0
    assert_equal_tensors(load_hf_state_dict(tmp_path / "a"), weights["actor_hf"])
    assert reshard(step, tmp_path / "c", "--to", "hf", "--role", "critic", "--config", base / "hf") == 0
    critic = load_hf_state_dict(tmp_path / "c")
    hf = load_hf_state_dict(base / "hf")
    assert_equal_tensors({n: t for n, t in critic.items() if n != "score.weight"},
                         {n: t for n, t in hf.items() if n != "lm_head.weight"})


def test_hf_to_fsdp_loads_into_an_engine_at_two_ranks_and_reads_back(saved, tmp_path):
    """The tool's FSDP output (world 1, whole tensors) loaded by FSDPEngine at 2 ranks holds the HF model;
    read by the tool again it is the HF model."""
    base, weights = saved
    hf = load_hf_state_dict(base / "hf")
    assert_equal_tensors(weights["from_hf"], hf)
    assert reshard(base / "from_hf", tmp_path / "back", "--to", "hf", "--verify") == 0
    assert_equal_tensors(load_hf_state_dict(tmp_path / "back"), hf)


def test_fsdp_refusals_name_the_directory(saved, tmp_path):
    base, _ = saved
    step = base / "checkpoints" / "step_000001"
    critic = step / "critic"
    with pytest.raises(ConfigError, match=rf"--role: {critic} holds a critic .*pass --role critic"):
        reshard_main([str(critic), str(tmp_path / "x"), "--to", "hf", "--config", str(base / "hf")])
    with pytest.raises(ConfigError, match=rf"--role: {step / 'actor'} holds an actor .*pass --role actor"):
        reshard_main([str(step / "actor"), str(tmp_path / "x"), "--to", "hf", "--role", "critic",
                      "--config", str(base / "hf")])
    bare = tmp_path / "bare"
    shutil.copytree(step / "actor", bare)
    (bare / "engine.json").unlink()
    with pytest.raises(ConfigError, match=rf"SRC: {bare} is a torch DCP checkpoint without engine.json"):
        reshard_main([str(bare), str(tmp_path / "x"), "--to", "hf", "--config", str(base / "hf")])
    with pytest.raises(ConfigError, match=r"--config: .* FSDP checkpoint without a config.json"):
        reshard_main([str(step), str(tmp_path / "x"), "--to", "hf"])
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((base / "hf" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ConfigError, match=rf"SRC: {step / 'actor'}: model.decoder.layers.0.mlp.fc1.weight is "
                                          r"\[192, 64\], this config's model has \[128, 64\]"):
        reshard_main([str(step), str(tmp_path / "x"), "--to", "hf", "--config", str(other)])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3_moe"])
def test_hf_to_fsdp_to_hf_is_bit_exact_with_qkv_bias_tied_and_bf16(tmp_path, family):
    """In one process: Qwen2 (QKV bias, tied embeddings: no lm_head in the engine), Mistral in bfloat16
    (the checkpoint keeps the dtype it is given; the engine casts on load) and Qwen3-MoE (QK-norm, a
    router and each expert's tensors)."""
    from tests.reshard.conftest import assert_same_hf, write_model

    write_model(tmp_path / "hf", family, dtype=torch.bfloat16 if family == "mistral" else torch.float32)
    assert reshard(tmp_path / "hf", tmp_path / "fsdp", "--to", "fsdp", "--verify") == 0
    assert json.loads((tmp_path / "fsdp" / "engine.json").read_text())["value_head"] is False
    assert reshard(tmp_path / "fsdp", tmp_path / "out", "--to", "hf", "--verify") == 0
    assert_same_hf(tmp_path / "hf", tmp_path / "out")
