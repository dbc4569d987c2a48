"""ObjectHandle: a value goes from one worker group to another through the object store by reference."""
import os
import pickle

import pytest
import torch

from hybridflow.controller import ObjectHandle, RayWorkerGroup, ResourcePool
from tests.controller.workers import Publisher, Receiver

pytestmark = pytest.mark.timeout(120)


def test_handle_passes_between_groups_without_the_value_on_the_driver(ray_cluster):
    source = RayWorkerGroup(Publisher, ResourcePool([0], "cpu"))
    sink = RayWorkerGroup(Receiver, ResourcePool([1, 0], "cpu"))
    try:
        rows = 256  # 1 MiB of float32
        handle = source.publish(rows)
        assert handle.in_object_store
        assert len(pickle.dumps(handle)) < 1024  # what the driver holds and forwards is a reference
        results = sink.checksum(handle)
        want = float(torch.arange(rows * 1024, dtype=torch.float32).sum())
        assert [total for _, total in results] == [want, want]
        assert all(pid != os.getpid() for pid, _ in results)
    finally:
        source.shutdown()
        sink.shutdown()


def test_without_ray_the_handle_holds_the_value(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not imported
    value = {"w": torch.ones(3)}
    handle = ObjectHandle(value)
    assert not handle.in_object_store and handle.get() is value
