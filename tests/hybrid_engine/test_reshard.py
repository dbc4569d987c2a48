"""The switch to generation on 4 gloo processes, all three groupings: fresh weights, the plan's bytes,
few collectives, the peak the plan predicts (one launch for every case)."""
import pytest
import torch

from hybridflow.controller.dispatch import MeshCoord, check_mesh

LAYOUTS = ("t4p1-tg2", "t4p1-tg1", "t2p2-tg2")
GROUPINGS = ("hybridflow", "vanilla", "full")


@pytest.fixture(scope="module")
def launched(four_process_launch):
    """reshard_check.py's results (in the suite's one 4-process launch, tests/conftest.py)."""
    return torch.load(four_process_launch["reshard"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_generation_weights_are_stale_after_a_step_until_refreshed(launched, layout, grouping):
    for rank, got in enumerate(launched[layout]):
        assert got[grouping]["stale"], rank  # the check below can fail: the step changed the weights
        assert got[grouping]["fresh"], rank  # every generation parameter equals shard(full weights, tg)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_switching_back_to_training_frees_the_generation_weights(launched, layout, grouping):
    """While training, the generation buffers hold nothing, and generating from them is refused; the
    next switch allocates them again (the freshness test above runs after this release)."""
    for rank, got in enumerate(launched[layout]):
        assert got[grouping]["released_numel"] == 0, rank
        assert got[grouping]["released_refused"], rank


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_received_are_the_plans(launched, layout, grouping):
    for rank, got in enumerate(launched[layout]):
        mine = got[grouping]
        runs = ("one_bucket", "small_buckets", "after") if grouping == "hybridflow" else ("one_bucket", "after")
        for run in runs:
            assert mine[run]["reshard/bytes_received"] == mine["planned_bytes"], (rank, run)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_sent_balance_the_bytes_received(launched, layout, grouping):
    """What the ranks send adds up to what they receive; at p = 1 each rank sends what the plan says.
    (At p > 1 a stage's root forwards pieces its TP peers gave it, so the senders differ from the
    plan's first holders while the totals agree.)"""
    ranks = [got[grouping]["after"] for got in launched[layout]]
    assert sum(r["reshard/bytes_sent"] for r in ranks) == sum(r["reshard/bytes_received"] for r in ranks)
    if layout.startswith("t4p1"):
        for rank, got in enumerate(launched[layout]):
            assert got[grouping]["after"]["reshard/bytes_sent"] == got[grouping]["planned_sent"], rank


@pytest.mark.timeout(400)
def test_buckets_set_the_number_of_collectives(launched):
    t4 = launched["t4p1-tg2"][0]
    assert t4["hybridflow"]["one_bucket"]["reshard/collectives"] == 1  # one all-gather for the whole model
    assert t4["vanilla"]["one_bucket"]["reshard/collectives"] == 1
    assert t4["hybridflow"]["small_buckets"]["reshard/collectives"] > 4
    assert t4["full"]["one_bucket"]["reshard/collectives"] > 4  # one per sharded tensor
    t2p2 = launched["t2p2-tg2"][0]
    assert t2p2["hybridflow"]["one_bucket"]["reshard/bytes_received"] > 0  # the other stage's layers arrive


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_peak_is_the_generation_shard_only_under_hybridflow(launched, layout):
    """hybridflow gathers straight into the generation shard: its peak is the shard's bytes, M/tg plus the
    replicated norms. vanilla and full hold a whole stage before cutting it (equal only at tg = 1, p = 1)."""
    for rank, got in enumerate(launched[layout]):
        shard = got["hybridflow"]["shard_bytes"]
        assert got["hybridflow"]["after"]["reshard/peak_bytes"] == shard, rank
        for other in ("vanilla", "full"):
            peak = got[other]["after"]["reshard/peak_bytes"]
            assert peak == shard if layout == "t4p1-tg1" else peak > shard, (rank, other)


@pytest.mark.timeout(400)
def test_generation_mesh_groups_the_ranks_of_one_generation_tp_group(launched):
    """At t=4 -> tg=2 the paper's generation TP groups are {0, 2} and {1, 3} (stride t/tg); vanilla's
    are consecutive. Each is one generation replica, answered for by its TP rank 0."""
    want = {"hybridflow": [(0, True), (1, True), (0, False), (1, False)],
            "vanilla": [(0, True), (0, False), (1, True), (1, False)]}
    for grouping, expected in want.items():
        coords = [MeshCoord(*ranks[grouping]["mesh"]) for ranks in launched["t4p1-tg2"]]
        check_mesh(grouping, coords)
        assert [(c.dp_rank, c.answers) for c in coords] == expected, grouping
    tg1 = [MeshCoord(*ranks["hybridflow"]["mesh"]) for ranks in launched["t4p1-tg1"]]
    assert [(c.dp_rank, c.dp_size, c.answers) for c in tg1] == [(r, 4, True) for r in range(4)]
