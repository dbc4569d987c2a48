"""The engine at pp 2 x virtual_pp 2 (megatron-core's interleaved schedule, two model chunks per rank)
equals one process: tests/engine/vpp_check.py in the suite's 2-process launch, against `compute` run here
on one rank from the same 4-layer HF model."""
from pathlib import Path

import pytest
import torch

from hybridflow.config.schema import ParallelConfig
from hybridflow.parallel.stages import chunk_layers, layer_place, local_name, param_place, stage_layers
from tests.engine.vpp_check import compute


def test_layers_go_round_robin_over_stages_then_chunks():
    # 8 layers, pp 2, vpp 2: blocks of 2, block j on stage j % 2 as chunk j // 2.
    assert [layer_place(i, 8, 2, 2) for i in range(8)] == [(0, 0), (0, 0), (1, 0), (1, 0),
                                                          (0, 1), (0, 1), (1, 1), (1, 1)]
    assert stage_layers(1, 8, 2, 2) == [2, 3, 6, 7]
    assert list(chunk_layers(0, 1, 8, 2, 2)) == [4, 5]
    assert [layer_place(i, 4, 2) for i in range(4)] == [(0, 0), (0, 0), (1, 0), (1, 0)]  # vpp 1: contiguous
    assert param_place("embedding.word_embeddings.weight", 8, 2, 2) == (0, 0)
    assert param_place("decoder.final_layernorm.weight", 8, 2, 2) == (1, 1)
    assert (local_name("decoder.layers.6.mlp.linear_fc1.weight", 8, 2, 2)
            == "chunk1.decoder.layers.0.mlp.linear_fc1.weight")
    assert local_name("decoder.layers.5.mlp.linear_fc1.weight", 8, 2) == "decoder.layers.1.mlp.linear_fc1.weight"
    with pytest.raises(ValueError, match="pp\\*vpp = 2\\*3 must divide the 8 layers"):
        layer_place(0, 8, 2, 3)


@pytest.fixture(scope="module")
def launched(two_process_launch):
    got = torch.load(two_process_launch["vpp"], weights_only=False)
    return got, compute(ParallelConfig(), str(Path(two_process_launch["vpp_dir"]) / "hf"))


@pytest.mark.timeout(600)
def test_chunks_hold_the_layers_parallel_stages_places_there(launched):
    assert launched[0]["chunk_layers"] == [[[0], [2]], [[1], [3]]]  # rank 0: chunks 0, 1; rank 1 likewise


@pytest.mark.timeout(600)
def test_forward_passes_equal_one_rank(launched):
    got, want = launched
    # The same layers in the same order on the same rows: only where a stage ends differs.
    for key in ("old_log_probs", "entropy", "values", "log_probs_one_micro_batch"):
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)


@pytest.mark.timeout(600)
def test_one_update_equals_one_rank(launched):
    got, want = launched
    assert got["metrics"].keys() == want["metrics"].keys()
    for key, value in want["metrics"].items():  # the gradient norm sums squares in another order: a tolerance
        assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, atol=1e-6, rtol=0, msg=name)


@pytest.mark.timeout(600)
def test_an_update_of_micro_batches_not_a_multiple_of_pp_equals_one_rank(launched):
    """3 micro-batches at pp 2: the interleaved schedule runs groups of pp, so the engine adds an empty one
    and scales the real losses by 4/3 (megatron-core divides by 4): one rounding more than one rank."""
    got, want = launched
    assert got["critic_update_micro_batches"] == [3]  # what the engine was handed
    assert got["critic_metrics"].keys() == want["critic_metrics"].keys()
    for key, value in want["critic_metrics"].items():
        assert got["critic_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    # The 4/3 scaling is one float32 rounding per loss, which the update carries into the weights and the
    # values after it: 1.3e-6 on values near 1 seen on an AVX2 machine, hence a relative term.
    torch.testing.assert_close(got["values_after_update"], want["values_after_update"], atol=1e-6, rtol=2e-6)
    assert not torch.equal(want["values_after_update"], want["values"])  # the update moved the values


@pytest.mark.timeout(600)
def test_generation_weights_export_and_checkpoint_resume_exactly(launched):
    from hybridflow.models.checkpoint import load_hf_state_dict

    got = launched[0]
    assert got["fresh_after_refresh"]
    exported = load_hf_state_dict(got["export_dir"])
    assert exported.keys() == got["weights"].keys()
    assert all(torch.equal(exported[n], v) for n, v in got["weights"].items())
    assert got["resumed_metrics"] == got["second_metrics"] and got["resume_weights_equal"]
    shard = torch.load(Path(got["shards"]) / "engine_tp0_pp1_dp0.pt", weights_only=True)["model"]
    assert "chunk1.decoder.layers.0.mlp.linear_fc1.weight" in shard  # global layer 3
    assert "chunk1.output_layer.weight" in shard  # the tied embedding's copy, on the last chunk


@pytest.mark.timeout(600)
def test_reshard_reads_and_writes_the_engines_chunked_shards(launched, tmp_path, capsys):
    """`hybridflow reshard` at virtual_pp 2: the engine's shards convert to its HF export bit for bit, and
    written from the HF model with --pp 2 --virtual-pp 2 they name and shape every tensor as the engine does."""
    from hybridflow.cli import main
    from hybridflow.models.checkpoint import load_hf_state_dict

    got = launched[0]
    hf = Path(got["export_dir"]).parent / "hf"
    assert main(["reshard", got["shards"], str(tmp_path / "hf"), "--to", "hf", "--config", str(hf),
                 "--no-progress"]) == 0
    converted, exported = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(got["export_dir"])
    assert converted.keys() == exported.keys() and all(torch.equal(converted[k], exported[k]) for k in exported)

    assert main(["reshard", str(hf), str(tmp_path / "ckpt"), "--to", "hybridflow", "--pp", "2", "--virtual-pp", "2",
                 "--no-progress"]) == 0
    for stage in (0, 1):
        name = f"engine_tp0_pp{stage}_dp0.pt"
        written = torch.load(tmp_path / "ckpt" / "step_000000" / "actor" / name, weights_only=True)["model"]
        engine = torch.load(Path(got["shards"]) / name, weights_only=True)["model"]
        assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in engine.items()}, stage
    assert main(["reshard", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--to", "hf", "--no-progress"]) == 0
    back, original = load_hf_state_dict(tmp_path / "back"), load_hf_state_dict(hf)
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    assert main(["reshard", str(hf), str(tmp_path / "x"), "--to", "hf", "--virtual-pp", "2", "--no-progress"]) == 2
    assert "--virtual-pp: model chunks per pipeline stage" in capsys.readouterr().err
    assert main(["reshard", str(hf), str(tmp_path / "y"), "--to", "hybridflow", "--pp", "2", "--virtual-pp", "4",
                 "--no-progress"]) == 2
    assert "--pp: pp*virtual_pp = 2*4 does not divide the model's 4 layers" in capsys.readouterr().err
