"""The load-balanced CP split: chunks r and 2*cp-1-r per rank, its positions and its inverse (no processes)."""
import pytest
import torch

from hybridflow.parallel.cp_split import cp_gather_order, cp_positions, cp_split, cp_unsplit


def test_cp2_positions_are_megatrons_chunks():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_gather_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert cp_positions(7, 1, 0).tolist() == list(range(7))  # cp = 1 cuts nothing: any length


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_round_trip_and_positions(cp, dim):
    x = torch.randn(3, 24, 5).movedim(1, dim)  # sequence of 24 along `dim`
    seq = torch.arange(24)
    parts, positions = zip(*(cp_split(x, cp, r, dim) for r in range(cp)))
    for part, pos in zip(parts, positions):
        assert part.shape[dim] == 24 // cp
        assert torch.equal(part, x.index_select(dim, pos))  # each token sits where its position says
    assert torch.equal(torch.sort(torch.cat(positions)).values, seq)  # every token on exactly one rank
    assert torch.equal(cp_unsplit(parts, dim), x)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_gets_the_same_causal_work(cp):
    # the point of the scheme: every rank's queries see the same number of keys under a causal mask
    work = [int((cp_positions(32, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1
    contiguous = [int((torch.arange(r * 32 // cp, (r + 1) * 32 // cp) + 1).sum()) for r in range(cp)]
    assert len(set(contiguous)) == cp


def test_refuses_uneven_sequences_and_ranks():
    with pytest.raises(ValueError, match="2\\*cp = 4"):
        cp_positions(10, 2, 0)
    with pytest.raises(ValueError, match="outside"):
        cp_positions(8, 2, 2)
