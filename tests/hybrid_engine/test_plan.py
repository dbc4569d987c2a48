"""The reshard plan as data, with no processes: groups, containment, coverage, bytes and fused re-laying."""
import itertools
from fractions import Fraction

import pytest
import torch

from hybridflow.hybrid_engine.plan import GenLayout, ParamInfo, bridge_params, plan_reshard
from hybridflow.models import DecoderConfig, get_bridge, shard_tensor
from hybridflow.parallel import ParallelDims

H = 48  # divisible by every t * blocks * d used below


def uniform_params(layers: int = 4) -> list[ParamInfo]:
    """Only TP-sharded layer weights, equal on every stage: the setting the paper's formulas assume."""
    out = []
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        out += [ParamInfo(pre + "self_attention.linear_qkv.weight", (3 * H, H)),
                ParamInfo(pre + "self_attention.linear_proj.weight", (H, H)),
                ParamInfo(pre + "mlp.linear_fc1.weight", (4 * H, H)),
                ParamInfo(pre + "mlp.linear_fc2.weight", (H, 2 * H))]
    return out


CASES = [(t, p, d, tg, pg) for t, p, d in itertools.product((1, 2, 4), (1, 2), (1, 2))
         for tg in (1, 2, 4) for pg in (1, 2) if t % tg == 0 and p % pg == 0]


def ids(case):
    return "t{}p{}d{}-tg{}pg{}".format(*case)


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("grouping", ["hybridflow", "vanilla", "full"])
def test_groups_partition_the_world(case, grouping):
    t, p, d, tg, pg = case
    plan = plan_reshard(uniform_params(), ParallelDims(tp=t, pp=p, dp=d), GenLayout(tg, pg), grouping)
    for groups, size in ((plan.gen_tp_groups, tg), (plan.micro_dp_groups, t * p // (tg * pg))):
        assert sorted(r for g in groups for r in g) == list(range(t * p * d))
        assert {len(g) for g in groups} == {size}


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_hybridflow_generation_shard_contains_the_training_shard(case):
    t, p, d, tg, pg = case
    plan = plan_reshard(uniform_params(), ParallelDims(tp=t, pp=p, dp=d), GenLayout(tg, pg), "hybridflow")
    for rank in range(t * p * d):
        assert plan.held[rank] <= plan.needed[rank], rank


def test_vanilla_generation_shard_does_not_contain_the_training_shard():
    """The negative case: consecutive generation TP groups break containment (paper figure 8: t=4, tg=2)."""
    plan = plan_reshard(uniform_params(), ParallelDims(tp=4, dp=2), GenLayout(tg=2), "vanilla")
    assert any(not plan.held[r] <= plan.needed[r] for r in range(8))
    paper = plan_reshard(uniform_params(), ParallelDims(tp=4, dp=2), GenLayout(tg=2), "hybridflow")
    assert paper.gen_tp_groups == [(0, 2), (1, 3), (4, 6), (5, 7)]  # [G1,G3],[G2,G4],[G5,G7],[G6,G8]
    assert paper.micro_dp_groups == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("grouping", ["hybridflow", "vanilla", "full"])
def test_bytes_per_rank_equal_the_formulas(case, grouping):
    t, p, d, tg, pg = case
    params = uniform_params()
    m = sum(x.nbytes for x in params)
    plan = plan_reshard(params, ParallelDims(tp=t, pp=p, dp=d), GenLayout(tg, pg), grouping)
    want = {"hybridflow": Fraction(t * p - tg * pg, tg * pg * t * p), "vanilla": Fraction(t * p - 1, t * p),
            "full": Fraction(t * p * d - 1, t * p * d)}[grouping] * m
    for rank in range(t * p * d):
        assert plan.bytes_received(rank) == want, (rank, plan.bytes_received(rank), want)
    assert sum(x.nbytes for x in plan.transfers) == sum(plan.bytes_sent(r) for r in range(t * p * d))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_every_tensor_is_covered_once_by_each_generation_tp_group(case):
    t, p, d, tg, pg = case
    params = uniform_params()
    plan = plan_reshard(params, ParallelDims(tp=t, pp=p, dp=d), GenLayout(tg, pg), "hybridflow")
    for replica in range(d):
        for micro in range(t * p // (tg * pg)):
            ranks = [r for r, g in enumerate(plan.gen_coords) if g.replica == replica and g.micro_dp_rank == micro]
            pieces = [piece for r in ranks for piece in plan.needed[r]]
            assert len(pieces) == len(set(pieces))  # once
            every = {(x.name, r, b) for x in params for r in range(t) for b in range(x.spec.blocks)}
            assert set(pieces) == every  # and all of them, over the group's stages


@pytest.mark.parametrize("t, tg", [(4, 2), (4, 1), (2, 1), (4, 4)])
def test_fused_tensors_are_re_laid_from_training_pieces(t, tg):
    """A generation shard assembled block by block from the plan's pieces equals sharding the full tensor
    at tg: grouped-query QKV (whole query groups) and SwiGLU [gate; up] (two blocks)."""
    cfg = DecoderConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                        num_heads=8, num_kv_heads=4, head_dim=8)
    bridge = get_bridge(cfg, 16, t)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in bridge.megatron_shapes().items()}
    plan = plan_reshard(bridge_params(bridge), ParallelDims(tp=t), GenLayout(tg), "hybridflow")
    for rank in range(t):
        j = plan.gen_coords[rank].tg_rank
        for entry in bridge.entries():
            spec = entry.shard
            if spec.dim is None:
                continue
            train_shards = {r: shard_tensor(full[entry.megatron], spec, r, t) for r in range(t)}
            mine = sorted((r, b) for n, r, b in plan.needed[rank] if n == entry.megatron)
            blocks = [torch.cat([train_shards[r].chunk(spec.blocks, spec.dim)[b] for r, bb in mine if bb == b],
                                spec.dim) for b in range(spec.blocks)]
            assembled = torch.cat(blocks, spec.dim)
            assert torch.equal(assembled, shard_tensor(full[entry.megatron], spec, j, tg)), (entry.megatron, rank)


def test_real_model_shapes_plan_and_norms_are_never_sent_within_a_stage():
    cfg = DecoderConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_layers=4, num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True,
                        tie_word_embeddings=True)
    plan = plan_reshard(bridge_params(get_bridge(cfg, 128, 2)), ParallelDims(tp=2, pp=2), GenLayout(tg=1), "hybridflow")
    for rank in range(4):
        assert plan.held[rank] <= plan.needed[rank]
    assert not [x for x in plan.transfers if "layernorm" in x.param and
                plan.train.coord(x.src).pp == plan.train.coord(x.dst).pp]


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="tg=3 must divide t=4"):
        plan_reshard(uniform_params(), ParallelDims(tp=4), GenLayout(tg=3))
    with pytest.raises(ValueError, match="grouping must be one of"):
        plan_reshard(uniform_params(), ParallelDims(tp=2), GenLayout(tg=1), "ring")


CP_CASES = [(t, p, d, tg) for t, p, d in ((2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)) for tg in (1, 2) if t % tg == 0]


@pytest.mark.parametrize("t, p, d, tg", CP_CASES)
@pytest.mark.parametrize("grouping", ["hybridflow", "vanilla"])
def test_context_parallel_ranks_are_generation_replicas_of_their_own(t, p, d, tg, grouping):
    """At cp = 2 each CP rank holds its training replica's whole shards (the context, not the weights, is
    split), so it plans as one more replica: the groups partition the world within one CP index, every
    generation TP group covers the model once, the bytes are the formula's, and the replicas number
    d * cp * t*p / tg, each served once."""
    cp, params = 2, uniform_params()
    train = ParallelDims(tp=t, pp=p, dp=d, cp=cp)
    m, world = sum(x.nbytes for x in params), t * p * d * cp
    plan = plan_reshard(params, train, GenLayout(tg), grouping)
    for groups in (plan.gen_tp_groups, plan.micro_dp_groups):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len({train.coord(r).cp for r in g}) == 1 for g in groups)  # never across CP ranks
    want = {"hybridflow": Fraction(t * p - tg, tg * t * p), "vanilla": Fraction(t * p - 1, t * p)}[grouping] * m
    assert all(plan.bytes_received(r) == want for r in range(world))
    assert all(train.coord(t_.src).cp == train.coord(t_.dst).cp for t_ in plan.transfers)
    served = {plan.generation_replica(r) for r in range(world) if plan.gen_coords[r].tg_rank == 0
              and plan.gen_coords[r].pg_stage == 0}
    count = d * cp * t * p // tg
    assert served == {(i, count) for i in range(count)}
    every = {(x.name, r, b) for x in params for r in range(t) for b in range(x.spec.blocks)}
    for group in plan.gen_tp_groups:
        if grouping == "hybridflow":
            pieces = [piece for r in group for piece in plan.needed[r]]
            assert len(pieces) == len(set(pieces)) and set(pieces) == every if p == 1 else True


def test_the_full_baseline_is_refused_at_cp_above_1():
    with pytest.raises(ValueError, match="cp = 2"):
        plan_reshard(uniform_params(), ParallelDims(tp=2, cp=2), GenLayout(1), "full")


def test_interleaved_training_stages_hold_their_chunks_layers():
    """At virtual_pp 2 stage s holds chunks (c * pp + s): layers {0, 1, 4, 5} and {2, 3, 6, 7} of 8 at pp 2
    (`parallel.stages`, the engine's placement); every needed piece still arrives once, as many bytes."""
    from hybridflow.parallel.stages import stage_layers

    train = ParallelDims(tp=2, pp=2, dp=2)
    plan = plan_reshard(uniform_params(8), train, GenLayout(tg=1), "hybridflow", virtual_pp=2)
    plain = plan_reshard(uniform_params(8), train, GenLayout(tg=1), "hybridflow")
    for rank in range(train.world_size):
        held = {int(name.split(".")[2]) for name, _, _ in plan.held[rank]}
        assert held == set(stage_layers(train.coord(rank).pp, 8, 2, 2)), rank
        received = {(t.param, t.piece[0], t.piece[1]) for t in plan.transfers if t.dst == rank}
        assert received == plan.needed[rank] - plan.held[rank]
    assert plan.needed_bytes == plain.needed_bytes
    assert sorted(t.nbytes for t in plan.transfers) == sorted(t.nbytes for t in plain.transfers)
    with pytest.raises(ValueError, match=r"p\*virtual_pp = 2\*4 must divide the 4 layers"):
        plan_reshard(uniform_params(4), ParallelDims(pp=2), GenLayout(tg=1), "hybridflow", virtual_pp=4)
