"""Row operations on batches (hybridflow/data/batch.py), and the mini-batch plan every layout shares."""
import pytest
import torch

from hybridflow.data import fields as F
from hybridflow.data.batch import (chunk_by_tokens, chunk_rows, concat, mask_padding, mini_batch_plan,
                                   mini_batch_rows, pad_rows, repeat_rows, row_count, rows_for_plan, select_fields,
                                   slice_rows, split_rows, take_rows, unpad)


def _batch(rows: int = 5) -> dict:
    return {F.INPUT_IDS: torch.arange(rows * 3).view(rows, 3), F.RESPONSE_MASK: torch.ones(rows, 2, dtype=torch.long),
            F.ADVANTAGES: torch.ones(rows, 2), F.UID: [f"u{i}" for i in range(rows)]}


def test_rows_are_taken_split_chunked_and_joined_with_their_lists():
    batch = _batch(6)
    assert row_count(batch) == 6
    picked = take_rows(batch, torch.tensor([4, 1]))
    assert picked[F.UID] == ["u4", "u1"] and picked[F.INPUT_IDS][0].tolist() == [12, 13, 14]
    assert take_rows(batch, torch.tensor([True, False] * 3))[F.UID] == ["u0", "u2", "u4"]
    halves = split_rows(batch, 2)
    assert [h[F.UID] for h in halves] == [["u0", "u1", "u2"], ["u3", "u4", "u5"]]
    joined = concat(halves)
    assert joined[F.UID] == batch[F.UID] and torch.equal(joined[F.INPUT_IDS], batch[F.INPUT_IDS])
    assert [row_count(c) for c in chunk_rows(batch, 4)] == [4, 2]
    assert slice_rows(batch, 1, 3)[F.UID] == ["u1", "u2"]
    twice = repeat_rows(take_rows(batch, torch.tensor([0, 1])), 2)  # prompt-major: the generator's order
    assert twice[F.UID] == ["u0", "u0", "u1", "u1"] and twice[F.INPUT_IDS][:, 0].tolist() == [0, 0, 3, 3]
    assert select_fields(batch, (F.UID, F.VALUES)) == {F.UID: batch[F.UID]}
    with pytest.raises(ValueError, match="does not split evenly over 4"):
        split_rows(batch, 4)
    with pytest.raises(ValueError, match="different row counts"):
        row_count({F.INPUT_IDS: torch.zeros(2, 1), F.UID: ["a"]})


def test_padding_is_masked_and_stripped():
    batch = _batch(5)
    padded, real = pad_rows(batch, 4)
    assert row_count(padded) == 8 and real.tolist() == [True] * 5 + [False] * 3
    assert padded[F.UID][5:] == ["u4"] * 3
    masked = mask_padding(padded, real)
    assert masked[F.RESPONSE_MASK][5:].sum() == 0 and masked[F.ADVANTAGES][5:].abs().sum() == 0
    assert masked[F.RESPONSE_MASK][:5].sum() == 10 and padded[F.RESPONSE_MASK].sum() == 16  # input untouched
    assert unpad(padded, real)[F.UID] == batch[F.UID]
    same, everything = pad_rows(batch, 5)
    assert same is batch and bool(everything.all())


def test_token_budgets_group_consecutive_rows():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    groups = chunk_by_tokens({F.ATTENTION_MASK: mask, F.INPUT_IDS: torch.arange(4)}, 5)
    assert [g[F.INPUT_IDS].tolist() for g in groups] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("rows,size,epochs", [(16, 8, 2), (13, 8, 1), (7, 4, 3), (3, 8, 1)])
def test_every_layout_trains_on_the_same_global_mini_batches(rows, size, epochs):
    """The replicas' shares of each step, joined in replica order, are the one-process mini-batch (padding
    slots aside), and each epoch visits every row once."""
    one = mini_batch_plan(rows, size, epochs, 1, torch.Generator().manual_seed(3))[0]
    for replicas in (1, 2, 4):
        plan = mini_batch_plan(rows, size, epochs, replicas, torch.Generator().manual_seed(3))
        assert len(plan) == replicas and all(len(p) == len(one) for p in plan)
        for k, want in enumerate(one):
            shares = [plan[r][k] for r in range(replicas)]
            assert len({len(s) for s in shares}) == 1  # every replica runs every step
            joined = torch.cat(shares)
            assert joined[joined >= 0].tolist() == want.tolist()
    per_epoch = len(one) // epochs
    for e in range(epochs):
        assert sorted(torch.cat(one[e * per_epoch:(e + 1) * per_epoch]).tolist()) == list(range(rows))


def test_a_replica_receives_only_its_rows_and_pads_with_masked_copies():
    batch = _batch(5)
    plan = mini_batch_plan(5, 4, 1, 2, None)  # mini-batches [0..3] and [4]: shares [0,1] [2,3], [4] [-1]
    assert [s.tolist() for s in plan[1]] == [[2, 3], [-1]]
    rows, steps = rows_for_plan(batch, plan[1])
    assert rows[F.UID] == ["u2", "u3"] and [s.tolist() for s in steps] == [[0, 1], [-1]]
    pad = mini_batch_rows(rows, steps[1])
    assert pad[F.RESPONSE_MASK].sum() == 0 and pad[F.ADVANTAGES].abs().sum() == 0
    lone, lone_steps = rows_for_plan(batch, [torch.tensor([-1])])  # only padding: one row to mask
    assert row_count(lone) == 1 and mini_batch_rows(lone, lone_steps[0])[F.RESPONSE_MASK].sum() == 0


def test_fields_kept_elsewhere_go_through_every_row_operation_as_their_values_would():
    """A RowsElsewhere field (its values in another process) selected, cut, joined and padded names exactly
    the rows the same operations pick from the values themselves; the fields of one answer keep sharing one
    row index through them (one index for all on the wire)."""
    from hybridflow.data.batch import Rows, RowsElsewhere, pad_rows, repeat_rows, split_rows, take_rows

    values = {"a": torch.arange(5) * 10, "b": torch.arange(7) * 10 + 1000}  # two sources' rows
    stores = {"a": {"x": values["a"], "y": values["a"] + 1}, "b": {"x": values["b"], "y": values["b"] + 1}}

    def answer(source: str) -> dict:
        rows = Rows((source,), (len(values[source]),), torch.arange(len(values[source]), dtype=torch.int32))
        return {"x": RowsElsewhere(rows, "x"), "y": RowsElsewhere(rows, "y"), "n": values[source] // 10}

    def resolve(field: RowsElsewhere) -> torch.Tensor:
        whole = torch.cat([stores[s][field.field] for s in field.rows.sources])
        return whole[field.rows.index.long()]

    joined = concat([answer("a"), answer("b"), answer("a")])
    assert joined["x"].rows is joined["y"].rows and len(joined["x"]) == 17
    assert torch.equal(resolve(joined["x"]), torch.cat([values["a"], values["b"], values["a"]]))
    assert joined["x"].rows.sources == ("a", "b")  # a source is held once however often it is joined
    order = torch.tensor([16, 3, 9, 0, 11, 5])
    for batch in (take_rows(joined, order), repeat_rows(take_rows(joined, order), 2),
                  pad_rows(take_rows(joined, order), 4)[0], *split_rows(take_rows(joined, order), 3)):
        assert batch["x"].rows is batch["y"].rows
        assert torch.equal(resolve(batch["x"]) // 10, batch["n"])  # the same rows as the plain field
        assert torch.equal(resolve(batch["y"]), resolve(batch["x"]) + 1)
    assert torch.equal(resolve(take_rows(joined["x"], order)), resolve(take_rows(joined, order)["x"]))


def test_a_padded_answer_stripped_keeps_its_fields_sharing_one_index_and_parts_must_agree():
    """DP_SPLIT strips the rows it padded from an answer field by field; the fields kept elsewhere still share
    one row index afterwards (counted and sent once). A field kept elsewhere in one part and not in another
    is an error naming the field."""
    from hybridflow.controller.dispatch import concat_batches, strip_padding, tensor_bytes
    from hybridflow.data.batch import Rows, RowsElsewhere

    def answer(source: str) -> dict:
        rows = Rows((source,), (4,), torch.arange(4, dtype=torch.int32))
        return {"x": RowsElsewhere(rows, "x"), "y": RowsElsewhere(rows, "y"), "n": torch.arange(4)}

    joined = concat_batches([answer("a"), answer("b")])
    real = torch.tensor([True] * 7 + [False])
    out = strip_padding(joined, real)
    assert out["x"].rows is out["y"].rows and len(out["x"]) == 7 and list(out) == ["x", "y", "n"]
    assert tensor_bytes(out) == 7 * 4 + 7 * 8  # one index of 7 int32 rows, and "n"
    with pytest.raises(ValueError, match="field 'x' is kept elsewhere in rank 0 and not in rank 1"):
        concat_batches([answer("a"), {"x": torch.zeros(4), "y": torch.zeros(4), "n": torch.arange(4)}])
