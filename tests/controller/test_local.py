"""LocalWorkerGroup: the same interface without Ray — in-process (world 1) and under torchrun (world 2)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridflow.controller import (Dispatch, LocalWorkerGroup, RayWorkerGroup, ResourcePool, RoleGroup, Worker,
                                   WorkerError, register, remote)
from tests.controller.workers import Echo, double_batch

REPO = Path(__file__).resolve().parents[2]


class _NoModel(Worker):
    def __init__(self):
        raise RuntimeError("no model")


def _batch(n=8):
    return {"x": torch.arange(n * 14, dtype=torch.int64).reshape(n, 14), "names": [f"q{i}" for i in range(n)]}


def test_world_of_one_runs_in_process():
    group = LocalWorkerGroup(Echo, None, offset=5)
    assert group.world_size == 1 and group.rank == 0
    assert group.call(Echo.whoami)[0]["offset"] == 5 and group.call(Echo.tag) == "rank0" and group.call(Echo.add, [4], b=[1]) == [5]
    owned = not dist.is_initialized()
    try:
        assert group.call(Echo.all_reduce, 2.0) == [2.0]  # a world of one forms its own gloo group
    finally:
        if owned:  # leave no default process group behind for other tests in this process
            dist.destroy_process_group()
    with pytest.raises(WorkerError, match="rank 0 failed in fail_on: ValueError") as err:
        group.call(Echo.fail_on, 0)
    assert "_raise_from_worker" in str(err.value) and isinstance(err.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="has 2 device"):
        LocalWorkerGroup(Echo, ResourcePool([0, 1]))
    with pytest.raises(WorkerError, match="rank 0 failed in __init__: RuntimeError: no model"):
        LocalWorkerGroup(_NoModel, None)


def test_calls_from_two_threads_take_turns_in_the_process():
    """The async DataFlow calls groups from a thread per stage. In one process they take turns, as the
    calls to a Ray actor do: generation and log-probs never run at once on one model."""
    import threading

    first, second = LocalWorkerGroup(Echo, None), LocalWorkerGroup(Echo, None)  # the actor and a critic
    spans = {}
    threads = [threading.Thread(target=lambda g=g, k=k: spans.update({k: g.call(Echo.span, 0.3)[0]}))
               for k, g in (("a", first), ("b", first), ("c", second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    ordered = sorted(spans.values())
    assert len(ordered) == 3 and all(end <= start for (_, end), (start, _) in zip(ordered, ordered[1:])), ordered


@pytest.mark.timeout(120)
def test_local_world_of_one_matches_the_ray_group(ray_cluster):
    batch = _batch()
    local = LocalWorkerGroup(Echo, None).call(Echo.double, batch, extra=1)
    ray_group = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    try:
        remote = ray_group.call(Echo.double, batch, extra=1)
    finally:
        ray_group.shutdown()
    assert torch.equal(local["x"], remote["x"]) and local["names"] == remote["names"]
    assert torch.equal(local["x"], double_batch(batch)["x"] + 1)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torchrun_two_ranks_split_and_gather():
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tests" / "controller" / "torchrun_dp_split.py")],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line, = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    report = json.loads(line.removeprefix("RESULT "))
    batch = _batch()
    assert report["rank"] == 0
    assert report["x"] == (double_batch(batch)["x"] + 1).tolist()
    assert report["names"] == double_batch(batch)["names"] and report["row_rank"] == [0] * 4 + [1] * 4
    assert report["whoami"] == [[0, 2, 3], [1, 2, 3]] and report["tag"] == "rank0"
    assert report["add"] == [11, 122] and report["all_reduce"] == [9.0, 9.0]
    assert report["gather_ranks"] == [[0, 1], [0, 1]]


def test_call_takes_only_the_workers_registered_methods():
    class Other(Worker):
        @register(Dispatch.DP_SPLIT)
        def double(self, batch):
            return batch

    group = LocalWorkerGroup(Echo, None)
    with pytest.raises(AttributeError, match=r"Echo.not_exposed is not a method registered"):
        group.call(Echo.not_exposed)
    with pytest.raises(TypeError, match=r"Other.double is not a method of Echo"):
        group.call(Other.double, {"x": torch.ones(2), "names": ["a", "b"]})
    assert group.call("tag") == "rank0"  # by name, too


def test_role_group_exposes_remote_methods_with_their_docs():
    class EchoGroup(RoleGroup):
        whoami = remote(Echo.whoami)
        all_reduce = remote(Echo.all_reduce)

    group = EchoGroup(LocalWorkerGroup(Echo, None, offset=4))
    assert group.whoami()[0]["offset"] == 4 and group.world_size == 1
    assert EchoGroup.all_reduce.__doc__ == Echo.all_reduce.__doc__
    with pytest.raises((TypeError, RuntimeError)) as err:  # 3.11 wraps __set_name__'s error
        class Renamed(RoleGroup):
            hello = remote(Echo.whoami)
    assert "use the same name" in str(err.value.__cause__ or err.value)
