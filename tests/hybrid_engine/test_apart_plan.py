"""The weight-sync plan for a rollout group apart, as data: run in one process (pack on the sender, unpack
on every receiver) it must rebuild every rollout rank's generation shard exactly, with the formula's bytes."""

import pytest
import torch

from hybridflow.hybrid_engine.apart import plan_apart
from hybridflow.hybrid_engine.plan import bridge_params
from hybridflow.parallel.stages import param_stage
from hybridflow.hybrid_engine.weight_sync import pack, unpack
from hybridflow.models import DecoderConfig, get_bridge, shard_tensor
from hybridflow.parallel import ParallelDims

CFG = DecoderConfig(model_type="qwen2", vocab_size=70, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=4, head_dim=8)
# (t, p, d) training, tg, rollout ranks: tg above, below and beside t, several rollout replicas and training
# replicas, pipelined training
CASES = [(t, p, d, tg, m) for t, p, d in [(1, 1, 1), (2, 1, 1), (1, 1, 2), (4, 1, 1), (2, 2, 1), (2, 1, 2)]
         for tg, m in [(1, 1), (2, 2), (1, 2), (2, 4), (4, 4)]]


def ids(case):
    return "t{}p{}d{}-tg{}m{}".format(*case)


def full_state(bridge, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=g) for p in bridge_params(bridge)}


def simulate(plan, bridge, full, holds=lambda rank, name: True):
    """Every broadcast run by hand: the sender's pack from its training shard, each receiver's unpack
    into an empty generation shard. Returns rollout rank -> megatron name -> received shard. `holds(rank,
    name)`: whether a training rank holds a tensor of its stage (an expert of another expert-parallel rank:
    not; a plan that had it send one fails in `pack`)."""
    train, tg = plan.train, plan.tg
    layers = CFG.num_layers
    held = {}  # training rank -> its shards
    for rank in range(train.world_size):
        c = train.coord(rank)
        held[rank] = {name: shard_tensor(t, bridge_entry(bridge, name).shard, c.tp, train.tp)
                      for name, t in full.items() if param_stage(name, layers, train.pp) == c.pp and holds(rank, name)}
    got = {i: {name: torch.full_like(shard_tensor(t, bridge_entry(bridge, name).shard, i % tg, tg), float("nan"))
               for name, t in full.items()} for i in range(plan.rollout_world)}
    for b in plan.broadcasts:
        flat = pack(b, held[b.src])
        assert flat.numel() * 4 == b.nbytes
        for dst in b.dsts:
            unpack(b, flat.clone(), got[dst - train.world_size])
    return got


def bridge_entry(bridge, name):
    return next(e for e in bridge.entries() if e.megatron == name)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_every_rollout_rank_gets_exactly_its_generation_shard(case):
    t, p, d, tg, m = case
    bridge = get_bridge(CFG, 8, t)
    train = ParallelDims(tp=t, pp=p, dp=d)
    plan = plan_apart(bridge_params(bridge), train, tg, m, bucket_bytes=4096)
    full = full_state(bridge)
    got = simulate(plan, bridge, full)
    for i in range(m):
        for name, tensor in full.items():
            want = shard_tensor(tensor, bridge_entry(bridge, name).shard, i % tg, tg)
            assert torch.equal(got[i][name], want), (i, name)  # no NaN left: every element written once
        # what it receives is its generation shard, nothing more: the formula
        assert plan.bytes_received(t * p * d + i) == plan.needed_bytes[i]
    shard = sum(pi.nbytes if pi.spec.dim is None else pi.nbytes // tg for pi in bridge_params(bridge))
    assert set(plan.needed_bytes.values()) == {shard}
    # the senders together send each receiver's shard once
    assert sum(plan.bytes_sent(r) for r in range(t * p * d)) == m * shard
    assert all(b.src < t * p * d <= min(b.dsts) for b in plan.broadcasts)


MOE = DecoderConfig(model_type="qwen3_moe", vocab_size=70, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=4, head_dim=8, num_experts=4, moe_top_k=2, moe_intermediate_size=16)


@pytest.mark.parametrize("t,p,d,c,ep", [(1, 1, 2, 1, 2), (2, 1, 2, 1, 2), (1, 2, 2, 1, 2), (1, 1, 1, 2, 2),
                                         (1, 1, 2, 2, 2), (1, 1, 2, 2, 4)])
def test_an_expert_parallel_actor_sends_each_expert_from_a_rank_that_trains_it(t, p, d, c, ep):
    """At ep > 1 a training rank holds only its expert-parallel rank's experts (megatron-core's expert ranks
    over the stage's dp x cp ranks); every expert slice comes from such a rank (the simulation holds no other
    and would fail to pack), every rollout rank still gets exactly its generation shard, all experts included,
    and the expert sending is spread over all of an expert's holders."""
    from hybridflow.engine.experts import expert_of, expert_rank

    bridge = get_bridge(MOE, 8, t)
    train = ParallelDims(tp=t, pp=p, dp=d, cp=c)

    def holds(rank, name):
        j, coord = expert_of(name), train.coord(rank)
        return j is None or j // (MOE.num_experts // ep) == expert_rank(coord.dp, coord.cp, c, ep)

    plan = plan_apart(bridge_params(bridge), train, 2, 4, bucket_bytes=4096, ep=ep)
    full = full_state(bridge)
    got = simulate(plan, bridge, full, holds)
    for i in range(4):
        for name, tensor in full.items():
            assert torch.equal(got[i][name], shard_tensor(tensor, bridge_entry(bridge, name).shard, i % 2, 2)), name
        assert plan.bytes_received(train.world_size + i) == plan.needed_bytes[i]
    senders = {b.src for b in plan.broadcasts for s in b.slices if expert_of(s.param) is not None}
    assert len(senders) == train.world_size  # each rank sends its own experts
    with pytest.raises(ValueError, match="ep=3 must divide the 4 experts"):
        plan_apart(bridge_params(bridge), train, 2, 4, ep=3)


def test_buckets_bound_the_collectives_and_training_replicas_share_the_sending():
    bridge = get_bridge(CFG, 8, 2)
    params = bridge_params(bridge)
    one = plan_apart(params, ParallelDims(tp=2), 2, 2, bucket_bytes=2**30)
    assert len(one.broadcasts) == 2  # one bucket from each training TP rank to its generation TP rank
    assert [b.group for b in one.broadcasts] == [(0, 2), (1, 3)]
    small = plan_apart(params, ParallelDims(tp=2), 2, 2, bucket_bytes=4096)
    largest = max(pi.nbytes // 2 for pi in params)
    assert all(b.nbytes <= max(4096, largest) for b in small.broadcasts) and len(small.broadcasts) > 2
    # Two training replicas share the sending into two rollout replicas (one broadcast reaches both).
    shared = plan_apart(params, ParallelDims(tp=2, dp=2), 2, 4)
    alone = plan_apart(params, ParallelDims(tp=2, dp=1), 2, 4)
    sent = [shared.bytes_sent(r) for r in range(4)]
    assert sum(sent) == alone.bytes_sent(0) + alone.bytes_sent(1)
    assert min(sent) > 0 and max(sent) <= 0.6 * max(alone.bytes_sent(0), alone.bytes_sent(1)), sent
    assert {len(b.dsts) for b in shared.broadcasts} == {2}
    # the replicated norms come from both training TP ranks, not only the first
    norms = {b.src for b in alone.broadcasts for s in b.slices if s.dim is None}
    assert norms == {0, 1}


def test_bad_layouts_are_refused():
    params = bridge_params(get_bridge(CFG, 8, 1))
    with pytest.raises(ValueError, match="tg=2 must divide the rollout group's 3 ranks"):
        plan_apart(params, ParallelDims(), 2, 3)
    with pytest.raises(ValueError, match="do not split"):
        plan_apart(params, ParallelDims(), 16, 16)  # the 72 rows of the padded vocabulary
