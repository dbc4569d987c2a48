"""ParallelDims: ranks <-> coordinates and named groups, checked against megatron-core's own RankGenerator."""
import itertools

import pytest

from hybridflow.parallel import Coord, ParallelDims

LAYOUTS = [ParallelDims(tp=t, pp=p, dp=d, cp=c)
           for t, p, d, c in itertools.product((1, 2, 4), (1, 2, 3), (1, 2), (1, 2)) if t * p * d * c <= 32]


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
def test_coordinates_round_trip(dims):
    coords = [dims.coord(r) for r in range(dims.world_size)]
    assert len(set(coords)) == dims.world_size
    assert [dims.rank(c) for c in coords] == list(range(dims.world_size))


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
def test_groups_match_megatron(dims):
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order="tp-cp-ep-dp-pp")
    for name, token in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("mp", "tp-cp-pp")):
        want = sorted(sorted(g) for g in gen.get_ranks(token))
        got = sorted(dims.groups(name))
        assert got == want, name
        assert sorted(r for g in got for r in g) == list(range(dims.world_size))  # a partition


def test_paper_example_8_ranks():
    dims = ParallelDims(tp=4, pp=1, dp=2)
    assert dims.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    dims = ParallelDims(tp=2, pp=2, dp=2)
    assert dims.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.coord(5) == Coord(tp=1, cp=0, dp=0, pp=1)


def test_replica_answers_come_from_the_last_stage_tp0():
    dims = ParallelDims(tp=2, pp=2, dp=2)
    assert dims.replica_ranks() == [4, 6]
    assert [r for r in range(8) if dims.answers_for_replica(r)] == [4, 6]


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
def test_a_span_holds_whole_groups(dims):
    """Each aligned block of `span(name)` consecutive ranks is a union of whole groups `name`."""
    for name in ("tp", "cp", "dp", "pp", "mp"):
        span = dims.span(name)
        assert dims.world_size % span == 0
        for group in dims.groups(name):
            assert group[0] // span == group[-1] // span, (name, group, span)
    assert (dims.span("tp"), dims.span("dp"), dims.span("pp")) == (
        dims.tp, dims.tp * dims.cp * dims.dp, dims.world_size)


def test_for_world_and_errors():
    assert ParallelDims.for_world(8, tp=2, pp=2) == ParallelDims(tp=2, pp=2, dp=2)
    assert ParallelDims.data_parallel_size(12, tp=2, pp=3) == 2
    assert ParallelDims.data_parallel_size(8, tp=2, cp=2) == 2
    assert ParallelDims.data_parallel_size(6, tp=4) is None
    with pytest.raises(ValueError, match=r"tp\*pp\*cp = 4\*1\*1 = 4 does not divide a world of 6"):
        ParallelDims.for_world(6, tp=4)  # a config that asks for it is refused first (tests/config), naming its key
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match="outside a world of 4"):
        ParallelDims(tp=2, dp=2).coord(4)
    with pytest.raises(KeyError, match="unknown group 'ep'"):
        ParallelDims().groups("ep")
