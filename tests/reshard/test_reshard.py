"""The reshard tool in one process: round trips bit-exact, the plan, the refusals and the atomic output.

Tiny random models (conftest); the megatron-core format and the runs that
load the tool's output are in test_reshard_dist.py and test_reshard_run.py.
"""
import json

import pytest
import torch

from hybridflow.checkpoint import shard_file
from hybridflow.errors import ConfigError
from hybridflow.models.checkpoint import INDEX_FILE
from hybridflow.reshard.cli import main
from tests.reshard.conftest import assert_same_hf, write_model


def reshard(*args) -> int:
    return main([str(a) for a in args] + ["--no-progress"])


def shards(root, role="actor"):
    """{file name: {tensor: value}} of a hybridflow checkpoint the tool wrote (its step 0)."""
    step = root / "step_000000"
    return {p.name: torch.load(p, weights_only=True)["model"] for p in sorted((step / role).glob("engine_*.pt"))}


def assert_same_shards(a, b) -> None:
    x, y = shards(a), shards(b)
    assert sorted(x) == sorted(y)
    for file in x:
        assert sorted(x[file]) == sorted(y[file]), file
        for name in x[file]:
            assert torch.equal(x[file][name], y[file][name]), (file, name)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama", "qwen3", "qwen3_moe"])
def test_hf_to_tp2pp2_to_tp1pp1_to_hf_is_bit_exact(tmp_path, family):
    write_model(tmp_path / "hf", family)
    assert reshard(tmp_path / "hf", tmp_path / "t2p2", "--to", "hybridflow", "--tp", 2, "--pp", 2) == 0
    files = sorted(p.name for p in (tmp_path / "t2p2" / "step_000000" / "actor").glob("*.pt"))
    assert files == sorted(shard_file(r, s) for r in range(2) for s in range(2))
    assert reshard(tmp_path / "t2p2", tmp_path / "t1p1", "--to", "hybridflow") == 0
    assert reshard(tmp_path / "t1p1", tmp_path / "out", "--to", "hf", "--verify") == 0
    assert_same_hf(tmp_path / "hf", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == family and config.get("sliding_window") == (8 if family == "mistral" else None)
    assert config["tie_word_embeddings"] == (family == "qwen2")


def test_hf_to_expert_parallel_layouts_and_back_is_bit_exact(tmp_path):
    """To tp2 x dp2 x ep2 (2 files per TP rank, each with half the experts under local numbers, the DP copies
    links) and to pp2 x cp2 x ep2 (the experts split over the CP ranks, CP rank 1's own `_cp1` files), on to tp1
    at ep1 and to HF: every tensor back bit for bit; the tp1 step equals a direct conversion."""
    from hybridflow.checkpoint.format import shard_coordinates

    write_model(tmp_path / "hf", "qwen3_moe")  # 4 experts
    assert reshard(tmp_path / "hf", tmp_path / "e2", "--to", "hybridflow", "--tp", 2, "--dp", 4, "--ep", 2) == 0
    assert reshard(tmp_path / "hf", tmp_path / "c2", "--to", "hybridflow", "--pp", 2, "--cp", 2, "--ep", 2) == 0
    assert reshard(tmp_path / "hf", tmp_path / "t1", "--to", "hybridflow") == 0
    e2, step = shards(tmp_path / "e2"), tmp_path / "e2" / "step_000000" / "actor"
    assert sorted(e2) == sorted(shard_file(r, 0, d) for r in range(2) for d in range(4))
    # megatron-core's expert ranks: DP ranks 0 and 2 hold the first two experts, 1 and 3 the last two.
    for r in range(2):
        assert [(step / shard_file(r, 0, d)).stat().st_ino for d in (2, 3)] == [
            (step / shard_file(r, 0, d)).stat().st_ino for d in (0, 1)]
    expert = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert {expert.format(0), expert.format(1)} <= e2[shard_file(0, 0, 1)].keys()
    assert expert.format(2) not in e2[shard_file(0, 0, 1)]
    assert not torch.equal(e2[shard_file(0, 0, 0)][expert.format(0)], e2[shard_file(0, 0, 1)][expert.format(0)])
    c2 = tmp_path / "c2" / "step_000000"
    assert sorted(shard_coordinates(p.name) for p in (c2 / "actor").glob("*.pt")) == [
        (0, s, 0, c) for s in range(2) for c in range(2)]
    assert json.loads((c2 / "trainer.json").read_text())["layouts"] == {"actor": "p2-t1-d1-c2-e2"}
    for name in ("e2", "c2"):
        assert reshard(tmp_path / name, tmp_path / f"{name}_t1", "--to", "hybridflow") == 0
        assert_same_shards(tmp_path / f"{name}_t1", tmp_path / "t1")
        assert reshard(tmp_path / name, tmp_path / f"{name}_hf", "--to", "hf", "--verify") == 0
        assert_same_hf(tmp_path / "hf", tmp_path / f"{name}_hf")


def test_tp4_to_tp2_and_pp2_to_pp1_equal_direct_conversions(tmp_path):
    write_model(tmp_path / "hf", "qwen2", num_key_value_heads=4)  # tp 4 needs 4 KV heads
    for name, tp, pp in (("t4", 4, 1), ("t2", 2, 1), ("p2", 1, 2), ("p1", 1, 1)):
        reshard(tmp_path / "hf", tmp_path / name, "--to", "hybridflow", "--tp", tp, "--pp", pp)
    reshard(tmp_path / "t4", tmp_path / "t4_t2", "--to", "hybridflow", "--tp", 2)
    reshard(tmp_path / "p2", tmp_path / "p2_p1", "--to", "hybridflow", "--pp", 1)
    assert_same_shards(tmp_path / "t4_t2", tmp_path / "t2")
    assert_same_shards(tmp_path / "p2_p1", tmp_path / "p1")
    # The tied embedding's last-stage copy at pp 2, as the engine loads it; vocabulary padded to 128 * tp.
    last = shards(tmp_path / "p2")[shard_file(0, 1)]
    assert torch.equal(last["output_layer.weight"], shards(tmp_path / "p1")[shard_file(0, 0)][
        "embedding.word_embeddings.weight"])
    assert shards(tmp_path / "t4")[shard_file(3, 0)]["embedding.word_embeddings.weight"].shape[0] == 512 // 4


def test_dp_copies_are_links_and_the_layout_is_recorded(tmp_path, qwen):
    assert reshard(qwen, tmp_path / "d2", "--to", "hybridflow", "--tp", 2, "--dp", 2) == 0
    step = tmp_path / "d2" / "step_000000"
    for r in range(2):
        a, b = step / "actor" / shard_file(r, 0, 0), step / "actor" / shard_file(r, 0, 1)
        assert a.stat().st_ino == b.stat().st_ino
    state = json.loads((step / "trainer.json").read_text())
    assert state["step"] == 0 and state["layouts"] == {"actor": "p1-t2-d2"} and "kl_coef" not in state
    assert (tmp_path / "d2" / "latest").read_text().strip() == "step_000000"


def test_sharded_hf_with_an_index_in_and_out(tmp_path):
    write_model(tmp_path / "hf", "llama")
    assert reshard(tmp_path / "hf", tmp_path / "sharded", "--to", "hf", "--max-shard-size", "20KiB") == 0
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert reshard(tmp_path / "sharded", tmp_path / "back", "--to", "hf", "--verify-logits") == 0
    assert_same_hf(tmp_path / "hf", tmp_path / "back")


def test_bfloat16_stays_bfloat16_and_a_cast_is_verified(tmp_path):
    write_model(tmp_path / "hf", "qwen2", dtype=torch.bfloat16)
    reshard(tmp_path / "hf", tmp_path / "t2", "--to", "hybridflow", "--tp", 2)
    assert all(t.dtype == torch.bfloat16 for f in shards(tmp_path / "t2").values() for t in f.values())
    assert reshard(tmp_path / "t2", tmp_path / "f32", "--to", "hf", "--dtype", "float32", "--verify") == 0


def test_critic_round_trip_keeps_its_value_head(tmp_path):
    write_model(tmp_path / "hf", "llama")
    reshard(tmp_path / "hf", tmp_path / "c2", "--to", "hybridflow", "--tp", 2, "--pp", 2, "--role", "critic")
    head = shards(tmp_path / "c2", "critic")[shard_file(1, 1)]["output_layer.weight"]
    assert head.shape == (1, 64) and not head.any()  # the engine's fresh value head
    assert reshard(tmp_path / "c2", tmp_path / "hf_critic", "--to", "hf", "--role", "critic", "--verify") == 0
    config = json.loads((tmp_path / "hf_critic" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and config["num_labels"] == 1
    from transformers import AutoModelForTokenClassification

    _, info = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf_critic", output_loading_info=True)
    assert not any(info.values()), info  # every tensor used, none missing (no score.bias expected)
    reshard(tmp_path / "hf_critic", tmp_path / "c1", "--to", "hybridflow", "--role", "critic")
    assert_same_shards_role(tmp_path / "c1", tmp_path / "c2")


def assert_same_shards_role(t1p1, t2p2) -> None:
    """The critic at TP1 x PP1 holds the same weights as at TP2 x PP2 (checked through HF)."""
    a, b = shards(t1p1, "critic")[shard_file(0, 0)], shards(t2p2, "critic")
    assert torch.equal(a["output_layer.weight"], b[shard_file(0, 1)]["output_layer.weight"])
    assert torch.equal(a["decoder.final_layernorm.weight"], b[shard_file(1, 1)]["decoder.final_layernorm.weight"])


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, qwen, capsys):
    assert reshard(qwen, tmp_path / "dst", "--to", "hybridflow", "--tp", 2, "--pp", 2, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "actor/engine_tp1_pp1_dp0.pt" in out and "linear_qkv.bias [64]" in out and "dry run" in out
    assert "total: 62 tensors in 4 file(s)" in out
    assert not (tmp_path / "dst").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("args, option, words", [
    (("--to", "hybridflow", "--tp", 3), "--tp", "does not divide the model's 4 attention heads"),
    (("--to", "hybridflow", "--tp", 4), "--tp", "does not divide the model's 2 KV heads"),
    (("--to", "hybridflow", "--pp", 8), "--pp", "8 pipeline stages for the model's 4 layers"),
    (("--to", "hybridflow", "--pp", 3), "--pp", "does not divide the model's 4 layers"),
    (("--to", "hf", "--tp", 2), "--tp", "HF checkpoints hold whole tensors"),
    (("--to", "hf", "--ep", 2), "--ep", "hf checkpoints hold whole tensors"),
    (("--to", "hybridflow", "--dp", 2, "--ep", 2), "--ep", "the model has no experts (a dense qwen2)"),
])
def test_refusals_before_anything_is_written(tmp_path, qwen, args, option, words):
    with pytest.raises(ConfigError) as err:
        reshard(qwen, tmp_path / "dst", *args)
    assert err.value.path == option and words in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_the_formats_table_finds_opens_and_refuses_by_format(tmp_path, qwen):
    """FORMATS is the one table of formats: `--to` takes its names, each SRC is held by exactly one entry (the
    one that opens it), and the refusals name the formats an option applies to from the entries' fields."""
    from hybridflow.reshard.cli import build_parser
    from hybridflow.reshard.formats import FORMATS, open_source

    assert build_parser()._option_string_actions["--to"].choices == tuple(FORMATS) == ("hf", "hybridflow", "dist",
                                                                                       "fsdp")
    reshard(qwen, tmp_path / "run", "--to", "hybridflow", "--tp", 2)
    reshard(qwen, tmp_path / "fsdp", "--to", "fsdp")
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    run, step = tmp_path / "run", tmp_path / "run" / "step_000000"
    for path, name in ((qwen, "hf"), (run, "hybridflow"), (step, "hybridflow"), (step / "actor", "hybridflow"),
                       (dist, "dist"), (tmp_path / "fsdp", "fsdp")):
        assert [n for n, f in FORMATS.items() if f.holds(path)] == [name], path
    assert open_source(qwen).kind == "hf" and open_source(dist, config=qwen).kind == "dist"
    source = open_source(run)
    assert source.kind == "hybridflow" and str(source.layout) == "p1-t2-d1" and source.step_dir == step
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no hybridflow actor checkpoint"):
        open_source(tmp_path / "empty")  # no format holds it: the hybridflow reader says what it looked for
    for args, option, text in [
            (("--to", "dist", "--pp", 2), "--pp", "dist checkpoints hold whole tensors; --pp, --dp, --cp and --ep "
                                                  "apply to --to hybridflow only"),
            (("--to", "hf", "--dp", 2), "--dp", "hf checkpoints hold whole tensors; --pp, --dp, --cp and --ep apply "
                                                "to --to hybridflow only"),
            (("--to", "hf", "--tp", 2), "--tp", "HF checkpoints hold whole tensors; --tp applies to --to hybridflow "
                                                "and dist"),
            (("--to", "dist", "--role", "critic"), "--to", "a critic has no megatron-core GPTModel form; convert it to "
                                                           "hf or hybridflow or fsdp")]:
        with pytest.raises(ConfigError) as err:
            reshard(qwen, tmp_path / "dst", *args)
        assert err.value.path == option and str(err.value) == f"{option}: {text}"


def test_unknown_architecture_and_non_empty_dst_are_refused(tmp_path, qwen):
    config = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        reshard(qwen, tmp_path / "dst", "--to", "hf")
    (qwen / "config.json").write_text(json.dumps(config))
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="pass --overwrite"):
        reshard(qwen, tmp_path / "dst", "--to", "hf")
    assert (tmp_path / "dst" / "keep.txt").read_text() == "mine"
    assert reshard(qwen, tmp_path / "dst", "--to", "hf", "--overwrite") == 0
    assert not (tmp_path / "dst" / "keep.txt").exists()
    assert_same_hf(qwen, tmp_path / "dst")


def test_an_hf_checkpoint_that_does_not_fit_its_config_is_refused(tmp_path, qwen):
    config = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    with pytest.raises(ConfigError, match="missing 12 tensor"):
        reshard(qwen, tmp_path / "dst", "--to", "hybridflow", "--tp", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_cli_prints_one_line_and_returns_2(tmp_path, qwen, capsys):
    from hybridflow.cli import main as hybridflow

    assert hybridflow(["reshard", str(qwen), str(tmp_path / "dst"), "--to", "hybridflow", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hybridflow: error: --tp: 3 does not divide the model's 4 attention heads"]
    assert hybridflow(["reshard", str(tmp_path / "nowhere"), str(tmp_path / "dst"), "--to", "hf"]) == 2
    assert "SRC: no checkpoint directory" in capsys.readouterr().err


def test_help_documents_every_form(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for form in ("--to hybridflow --tp 2 --pp 2", "--to hf --config", "--to dist --tp 2", "--role critic",
                 "--dry-run", "--verify", "--verify-logits", "--overwrite", "--max-shard-size"):
        assert form in text, form
