"""Dispatch/collect modes as pure functions: no processes."""
import pytest
import torch

from hybridflow.controller.dispatch import (Dispatch, batch_size, collect, concat_batches, dispatch, register,
                                            registered_methods, split_batch)


def _batch(n=6):
    return {"x": torch.arange(n * 3).reshape(n, 3), "names": [f"p{i}" for i in range(n)]}


def test_split_then_concat_is_identity_in_order():
    batch = _batch()
    chunks = split_batch(batch, 3)
    assert [c["names"] for c in chunks] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    back = concat_batches(chunks)
    assert torch.equal(back["x"], batch["x"]) and back["names"] == batch["names"]


def test_uneven_and_inconsistent_batches_are_rejected():
    with pytest.raises(ValueError, match="7 rows does not split evenly over 2"):
        split_batch(_batch(7), 2)
    with pytest.raises(ValueError, match="different row counts"):
        batch_size({"x": torch.zeros(4, 2), "names": ["a"]})
    with pytest.raises(TypeError, match=r"\['lr'\]"):
        batch_size({"x": torch.zeros(4, 2), "lr": 0.1})
    with pytest.raises(TypeError, match="first positional argument"):
        dispatch(Dispatch.DP_SPLIT, 2, (), {"batch": _batch()})


def test_dp_split_passes_other_arguments_unchanged():
    per_rank = dispatch(Dispatch.DP_SPLIT, 2, (_batch(4), 5), {"scale": 2.0})
    assert [args[1] for args, _ in per_rank] == [5, 5]
    assert [kwargs for _, kwargs in per_rank] == [{"scale": 2.0}] * 2
    assert [args[0]["names"] for args, _ in per_rank] == [["p0", "p1"], ["p2", "p3"]]


def test_collect_concatenates_fields_and_lists_scalars_per_rank():
    parts = [{"y": torch.ones(2), "t": 0.5, "names": ["a", "b"]}, {"y": torch.zeros(2), "t": 0.7, "names": ["c", "d"]}]
    out = collect(Dispatch.DP_SPLIT, parts)
    assert torch.equal(out["y"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert out["names"] == ["a", "b", "c", "d"] and out["t"] == [0.5, 0.7]
    assert collect(Dispatch.DP_SPLIT, [None, None]) is None
    with pytest.raises(ValueError, match="rank 1 returned"):
        concat_batches([{"y": 1}, {"z": 1}])


def test_one_to_all_rank_zero_all_to_all():
    assert dispatch(Dispatch.ONE_TO_ALL, 3, (1,), {"k": 2}) == [((1,), {"k": 2})] * 3
    assert collect(Dispatch.ONE_TO_ALL, [1, 2, 3]) == [1, 2, 3]
    assert collect(Dispatch.RANK_ZERO, ["zero", "one"]) == "zero"
    assert dispatch(Dispatch.ALL_TO_ALL, 2, ([1, 2],), {"b": [3, 4]}) == [((1,), {"b": 3}), ((2,), {"b": 4})]
    with pytest.raises(ValueError, match="argument 'b' must be a list with one value per rank"):
        dispatch(Dispatch.ALL_TO_ALL, 2, ([1, 2],), {"b": 3})


def test_register_marks_methods_and_overrides_without_tag_hide_them():
    class Base:
        @register(Dispatch.DP_SPLIT)
        def forward(self, batch):
            return batch

        @register("rank_zero")
        def metrics(self):
            return {}

    class Child(Base):
        def metrics(self):  # overridden without a mode: no longer a group method
            return {}

    assert registered_methods(Base) == {"forward": Dispatch.DP_SPLIT, "metrics": Dispatch.RANK_ZERO}
    assert registered_methods(Child) == {"forward": Dispatch.DP_SPLIT}
    with pytest.raises(ValueError, match="unknown dispatch mode 'dp_slpit'"):
        register("dp_slpit")


def _mesh(dims):
    from hybridflow.controller.dispatch import MeshCoord

    return [MeshCoord(dims.coord(r).dp, dims.dp, dims.answers_for_replica(r)) for r in range(dims.world_size)]


def test_dp_split_over_a_mesh_sends_a_replica_the_same_rows_and_keeps_one_answer_each():
    """TP x PP peers of one replica see the same rows; the result is one answer per replica."""
    from hybridflow.controller.dispatch import Dispatch, collect, dispatch
    from hybridflow.parallel import ParallelDims

    dims = ParallelDims(tp=2, pp=2, dp=2)  # 8 ranks; replica 0 = ranks 0,1,4,5; replica 1 = 2,3,6,7
    mesh = _mesh(dims)
    batch = {"x": torch.arange(6)}
    per_rank = dispatch(Dispatch.DP_SPLIT, 8, (batch, 7), {}, mesh)
    rows = [args[0]["x"].tolist() for args, _ in per_rank]
    assert rows == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]] * 2
    assert all(args[1] == 7 for args, _ in per_rank)
    # Only ranks 4 (replica 0) and 6 (replica 1) answer: the last stage, TP rank 0.
    results = [{"y": torch.full((3,), float(rank))} for rank in range(8)]
    assert collect(Dispatch.DP_SPLIT, results, mesh)["y"].tolist() == [4.0] * 3 + [6.0] * 3


def test_a_flat_split_over_tp_peers_is_what_mixed_rows_before_meshes():
    """Without a mesh, two TP peers got different rows (the critic tp=2 bug): meshes exist to stop that."""
    from hybridflow.controller.dispatch import Dispatch, dispatch
    from hybridflow.parallel import ParallelDims

    batch = {"x": torch.arange(4)}
    flat = [a[0]["x"].tolist() for a, _ in dispatch(Dispatch.DP_SPLIT, 2, (batch,), {})]
    assert flat == [[0, 1], [2, 3]]
    meshed = [a[0]["x"].tolist() for a, _ in dispatch(Dispatch.DP_SPLIT, 2, (batch,), {}, _mesh(ParallelDims(tp=2)))]
    assert meshed == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_meshes_are_checked():
    from hybridflow.controller.dispatch import MeshCoord, check_mesh, register

    with pytest.raises(ValueError, match="exactly one answering rank"):
        check_mesh("actor", [MeshCoord(0, 1, True), MeshCoord(0, 1, True)])
    with pytest.raises(ValueError, match="disagree on the number of replicas"):
        check_mesh("actor", [MeshCoord(0, 1, True), MeshCoord(1, 2, True)])
    with pytest.raises(ValueError, match="only applies to DP_SPLIT"):
        register("one_to_all", mesh="actor")


def test_a_padded_answer_loses_the_padded_rows_and_their_samples():
    """`strip_padding` drops padded rows, also from answers with k rows per batch row (a rollout's n
    samples of each prompt, prompt-major); values that are not per-row stay."""
    from hybridflow.controller.dispatch import strip_padding

    real = torch.tensor([True, True, False])
    answer = {"prompt_rows": torch.arange(3), "samples": torch.arange(6), "names": ["a", "b", "c"], "loss": 0.5}
    out = strip_padding(answer, real)
    assert out["prompt_rows"].tolist() == [0, 1] and out["samples"].tolist() == [0, 1, 2, 3]
    assert out["names"] == ["a", "b"] and out["loss"] == 0.5
    per_rank = concat_batches([{"loss": 0.1}, {"loss": 0.2}])  # two ranks, one real row: still two values
    assert strip_padding(per_rank, torch.tensor([True, False]))["loss"] == [0.1, 0.2]
    assert strip_padding(answer, None) is answer


def test_reads_are_declared_for_dp_split_only():
    from hybridflow.controller.dispatch import call_batch, method_reads, register

    @register(Dispatch.DP_SPLIT, reads=("x",))
    def f(self, batch):
        return batch

    assert method_reads(f) == ("x",)
    (shipped,), real = call_batch(f, ({"x": torch.arange(3), "y": torch.arange(3)},), 2)
    assert list(shipped) == ["x"] and shipped["x"].tolist() == [0, 1, 2, 2] and real.tolist() == [True] * 3 + [False]
    with pytest.raises(ValueError, match="reads only applies to DP_SPLIT"):
        register(Dispatch.ONE_TO_ALL, reads=("x",))
    with pytest.raises(ValueError, match=r"f \(reads \('x',\)\) needs a batch .* empty batch dict"):
        call_batch(f, ({"y": torch.arange(3)},), 2)  # none of the fields it reads
    with pytest.raises(TypeError, match="needs a batch"):
        call_batch(f, (3,), 2)
