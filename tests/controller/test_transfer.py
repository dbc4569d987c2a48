"""How values travel: tensors as numpy views (no copy on the sender), and ObjectHandle between groups."""
import os
import pickle
import time

import pytest
import torch

from hybridflow.controller import ObjectHandle, RayWorkerGroup, ResourcePool
from hybridflow.controller.dispatch import concat_batches, split_batch
from hybridflow.controller.transfer import pack, unpack, unpack_results
from tests.controller.workers import Publisher, Receiver, RowSource

pytestmark = pytest.mark.timeout(120)


def test_handle_passes_between_groups_without_the_value_on_the_driver(ray_cluster):
    source = RayWorkerGroup(Publisher, ResourcePool([0], "cpu"))
    sink = RayWorkerGroup(Receiver, ResourcePool([1, 0], "cpu"))
    try:
        rows = 256  # 1 MiB of float32
        handle = source.call(Publisher.publish, rows)
        assert handle.in_object_store
        assert len(pickle.dumps(handle)) < 1024  # what the driver holds and forwards is a reference
        results = sink.call(Receiver.checksum, handle)
        want = float(torch.arange(rows * 1024, dtype=torch.float32).sum())
        assert [total for _, total in results] == [want, want]
        assert all(pid != os.getpid() for pid, _ in results)
    finally:
        source.shutdown()
        sink.shutdown()


def test_rows_left_in_the_object_store_reach_another_group_in_any_order_without_the_driver(ray_cluster):
    """A group's answer holds references to its rows (tens of bytes a row, no tensor bytes on the driver);
    the driver shuffles, pads and splits them like any per-row field, and the other group's workers get
    exactly those rows as tensors."""
    from hybridflow.data.batch import RowsElsewhere, take_rows

    source = RayWorkerGroup(RowSource, ResourcePool([0, 1], "cpu"))
    sink = RayWorkerGroup(Receiver, ResourcePool([1, 0], "cpu"))
    try:
        batch = source.call(RowSource.make, torch.arange(8))
        # the mask, and each rank's row index of the ids (4 bytes a row): the ids stayed in the object store
        assert source.received_bytes == 8 * 2 * 8 + 8 * 4
        assert isinstance(batch["ids"], RowsElsewhere) and len(batch["ids"]) == 8
        assert len(pickle.dumps(batch["ids"])) < 8 * 256 * 8 / 4  # references: far below the rows' bytes
        order = torch.tensor([5, 0, 7, 2, 6, 1, 3])  # 7 rows over 2 ranks: padded to 8 by the call
        out = sink.call(Receiver.rows_back, take_rows(batch, order))
        want = order.view(-1, 1) * 1000 + torch.arange(256).view(1, -1)
        assert torch.equal(out["ids"], want)
        assert sink.shipped_bytes == 8 * 2 * 8 + 8 * 4  # the mask (padded to 8 rows), the ids' row index
        assert all(pid != os.getpid() for pid in out["pid"])
    finally:
        source.shutdown()
        sink.shutdown()


def test_rows_whose_owner_died_are_reported_with_the_owners_rank_and_role(ray_cluster):
    """Rows stay in the object store as long as the process that put them: when that process has exited,
    the rank reading them fails with Ray's OwnerDiedError, which names a worker id only. The driver's error
    names the owner's rank and workers (was: the reading rank's failure, as if it were at fault)."""
    import signal

    from hybridflow.controller import WorkerError

    source = RayWorkerGroup(RowSource, ResourcePool([0, 1], "cpu"))
    sink = RayWorkerGroup(Receiver, ResourcePool([1, 0], "cpu"))
    try:
        # 64 rows of 2 KiB a rank: above Ray's 100 KiB for objects it copies into the references themselves
        batch = source.call(RowSource.make, torch.arange(128))
        os.kill(source.pids()[1], signal.SIGKILL)  # rank 1 made rows 64-127
        lost = batch["ids"].rows.sources[1]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until Ray has freed what the dead process owned
            try:
                ray_cluster.get(lost, timeout=10)
            except ray_cluster.exceptions.OwnerDiedError:
                break
            time.sleep(0.2)
        with pytest.raises(WorkerError) as failed:
            sink.call(Receiver.rows_back, batch)
        message = str(failed.value)
        first = message.splitlines()[0]  # what a one-line report shows
        assert first.startswith("rank ") and "failed in rows_back: rows it read are lost: rank 1 of RowSource " \
            "(node " in first and "whose process kept them in the object store, has exited (OwnerDiedError" in first, \
            message
    finally:
        source.shutdown()
        sink.shutdown()


def test_without_ray_the_handle_holds_the_value(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not imported
    value = {"w": torch.ones(3)}
    handle = ObjectHandle(value)
    assert not handle.in_object_store and handle.get() is value


def test_chunks_travel_as_their_own_rows_without_a_copy():
    """A DP chunk is a view; packed for Ray it pickles only its own rows, and the driver copies nothing."""
    x = torch.arange(4000, dtype=torch.float32).reshape(1000, 4)
    chunk = split_batch({"x": x, "ids": x.long(), "h": x.bfloat16(), "names": ["a"] * 1000}, 4)[1]
    assert chunk["x"].untyped_storage().nbytes() == x.nbytes  # a view: pickling it would ship all rows
    packed = pack(chunk)
    assert packed["x"].array.ctypes.data == chunk["x"].data_ptr()  # no copy on the sender
    wire = pickle.dumps(packed, protocol=5)
    whole = x.nbytes + x.long().nbytes + x.bfloat16().nbytes
    assert whole // 4 < len(wire) < whole // 3  # only this rank's rows of each field
    back = unpack(pickle.loads(wire))
    for key in ("x", "ids", "h"):
        assert back[key].dtype == chunk[key].dtype and torch.equal(back[key], chunk[key]), key
    assert back["names"] == chunk["names"]


def test_gathered_results_are_concatenated_from_read_only_views_into_owned_tensors():
    parts = [{"x": torch.full((2, 3), float(r)), "maybe": torch.ones(2) if r else None, "n": [r, r]}
             for r in range(2)]
    wired = [pickle.loads(pickle.dumps(pack(p), protocol=5)) for p in parts]
    for p in wired:  # as out of the object store: read-only
        for value in p.values():
            if hasattr(value, "array"):
                value.array.flags.writeable = False
    views = unpack_results(wired)
    assert views[0]["x"].data_ptr() == wired[0]["x"].array.ctypes.data  # a view, left for torch.cat to copy
    # not a tensor on every rank: unpacked as usual, copied out of the read-only buffer
    assert views[1]["maybe"].data_ptr() != wired[1]["maybe"].array.ctypes.data
    out = concat_batches(views)
    out["x"].add_(1)  # the concatenation owns its memory
    assert out["x"][:, 0].tolist() == [1, 1, 2, 2] and out["n"] == [0, 0, 1, 1]
    assert out["maybe"][0] is None and torch.equal(out["maybe"][1], torch.ones(2))


def test_a_fresh_worker_gets_bfloat16_as_bfloat16(ray_cluster):
    """The first thing a new worker process does is unpack its arguments (nothing packed there yet)."""
    group = RayWorkerGroup(Receiver, ResourcePool([0], "cpu"))
    try:
        got = group.call(Receiver.dtypes, {"bf": torch.ones(2, 3, dtype=torch.bfloat16), "ids": torch.arange(6).view(2, 3),
                            "flag": torch.ones(2, dtype=torch.bool), "neg": torch.ones(2, 2).neg().conj()})
        assert got == [{"bf": "torch.bfloat16", "ids": "torch.int64", "flag": "torch.bool", "neg": "torch.float32"}]
    finally:
        group.shutdown()
