"""HF <-> Megatron <-> generation: exact round trips and real Megatron names/shapes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.models import (
    DecoderConfig, get_bridge, load_hf_state_dict, padded_vocab_size, shard_tensor, spec_for,
    unshard_tensor)
from hybridflow.models.bridge import fuse_qkv, split_qkv

REPO = Path(__file__).resolve().parents[2]


def _cfg_and_weights(path):
    return DecoderConfig.from_pretrained(path), load_hf_state_dict(path)


def test_hf_megatron_hf_round_trip_is_bit_exact(hf_checkpoint):
    _, path = hf_checkpoint
    cfg, hf = _cfg_and_weights(path)
    bridge = get_bridge(cfg)
    mc = bridge.hf_to_megatron(hf)
    assert mc["embedding.word_embeddings.weight"].shape[0] == bridge.padded_vocab == 128
    back = bridge.megatron_to_hf(mc)
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    gen = bridge.hf_to_generation(hf)
    for name, t in bridge.generation_to_hf(gen).items():
        assert torch.equal(t, hf[name]), name


def test_megatron_to_generation_is_views_not_copies(hf_checkpoint):
    _, path = hf_checkpoint
    cfg, hf = _cfg_and_weights(path)
    bridge = get_bridge(cfg)
    mc = bridge.hf_to_megatron(hf)
    gen = bridge.megatron_to_generation(mc)
    for e in bridge.entries():
        assert gen[e.generation].data_ptr() == mc[e.megatron].data_ptr(), e.generation
    assert torch.equal(gen["embed.weight"], hf["model.embed_tokens.weight"])


def test_grouped_qkv_layout_matches_megatron_convention():
    """Megatron: rows per query group are [q heads of the group, k, v]."""
    cfg = DecoderConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=4,
                        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads 0..3
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, cfg)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, cfg), (q, k, v)))


@pytest.fixture(scope="module")
def megatron_shapes(tmp_path_factory):
    """{family: (its HF directory, {name: shape} of a real megatron-core GPTModel built from it)}: one
    subprocess builds all the families' models."""
    from tests.models.conftest import FAMILIES, build_hf_model

    dirs = {}
    for family in FAMILIES:
        dirs[family] = tmp_path_factory.mktemp(family)
        build_hf_model(family, vocab_size=200).save_pretrained(dirs[family])
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/models/megatron_shapes.py"), "64", *map(str, dirs.values())],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(x[len("SHAPES "):].split("=", 1) for x in proc.stdout.splitlines() if x.startswith("SHAPES "))
    return {family: (path, {k: tuple(v) for k, v in json.loads(lines[str(path)]).items()})
            for family, path in dirs.items()}


def test_names_and_shapes_match_a_real_megatron_gptmodel(family, megatron_shapes):
    path, real = megatron_shapes[family]
    cfg = DecoderConfig.from_pretrained(path)
    ours = get_bridge(cfg, make_vocab_size_divisible_by=64).megatron_shapes()
    assert ours == real
    mc = get_bridge(cfg, 64).hf_to_megatron(load_hf_state_dict(path))
    assert {k: tuple(v.shape) for k, v in mc.items()} == real


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharding_plan_round_trips_and_splits_like_megatron(tp, tmp_path):
    from tests.models.conftest import build_hf_model

    build_hf_model("llama-mha-llama3-rope").save_pretrained(tmp_path)
    cfg, hf = _cfg_and_weights(tmp_path)
    assert cfg.rope_scaling["rope_type"] == "llama3"  # the parity test covers llama3 RoPE too
    bridge = get_bridge(cfg, make_vocab_size_divisible_by=8, tp=tp)
    mc = bridge.hf_to_megatron(hf)
    for name, full in mc.items():
        spec = spec_for(name)
        pieces = [shard_tensor(full, spec, r, tp) for r in range(tp)]
        assert torch.equal(unshard_tensor(pieces, spec), full), name
    # fc1 on rank r is [gate_r; up_r], as Megatron's ColumnParallelLinear holds it.
    fc1 = mc["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    for r in range(tp):
        expect = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        assert torch.equal(shard_tensor(fc1, spec_for("x.linear_fc1.weight"), r, tp), expect)
    # A QKV shard holds whole query groups: rank r's k rows are kv heads of rank r.
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]
    shard = shard_tensor(qkv, spec_for("x.linear_qkv.weight"), tp - 1, tp)
    _, k, _ = split_qkv(qkv, cfg)
    sub_cfg = DecoderConfig(**{**cfg.as_dict(), "num_heads": cfg.num_heads // tp,
                               "num_kv_heads": cfg.num_kv_heads // tp})
    assert torch.equal(split_qkv(shard, sub_cfg)[1], k.chunk(tp)[tp - 1])


def test_padded_vocab_size():
    assert padded_vocab_size(103, 128, 1) == 128
    assert padded_vocab_size(151936, 128, 8) == 152576
    assert padded_vocab_size(256, 128, 2) == 256


def test_bridge_rejects_wrong_checkpoints(tmp_path):
    from tests.models.conftest import build_hf_model

    build_hf_model("llama-gqa").save_pretrained(tmp_path)
    cfg, hf = _cfg_and_weights(tmp_path)
    bridge = get_bridge(cfg)
    with pytest.raises(KeyError, match="missing 1 tensor"):
        bridge.hf_to_megatron({k: v for k, v in hf.items() if "layers.1.mlp.up_proj" not in k})
    with pytest.raises(KeyError, match="unexpected tensor"):
        bridge.hf_to_megatron({**hf, "model.layers.9.mlp.up_proj.weight": hf["lm_head.weight"]})


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 1, "attention_bias": True, "model_type": "qwen2"}],
                         ids=["llama", "qwen2-gqa-bias"])
def test_read_rows_reads_a_chunk_of_the_fused_tensor_from_its_hf_rows_only(overrides):
    """FSDP's loader reads rows [start, stop) of each fused tensor (qkv by query group, [gate; up]) from the
    HF rows they come from: equal to slicing the whole fused tensor, for every chunking of 1 to 5 ranks, and
    each read names only rows inside its HF tensor."""
    from hybridflow.models.bridge import get_bridge
    from tests.engine.conftest import tiny_model

    cfg, _, hf = tiny_model(**overrides)
    bridge = get_bridge(cfg)
    reads = []

    class Reader:
        def __call__(self, name, rows=None, cols=None):
            assert rows is not None and 0 <= rows.start < rows.stop <= len(hf[name]), (name, rows)
            reads.append(rows.stop - rows.start)
            return hf[name][rows]

        def shape(self, name):
            return tuple(hf[name].shape)

    for e in bridge.entries():
        whole = bridge.fuse_parts(e, [hf[n] for n in e.hf])
        for ranks in range(1, 6):
            chunk = -(-whole.shape[0] // ranks)
            for start in range(0, whole.shape[0], chunk):
                stop = min(start + chunk, whole.shape[0])
                reads.clear()
                assert torch.equal(bridge.read_rows(e, Reader(), start, stop), whole[start:stop]), (e.generation, start)
                assert sum(reads) == stop - start  # no HF row read that the chunk does not hold
