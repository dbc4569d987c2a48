"""Worker processes kept warm between groups (`keep_processes_warm`, on for the whole test session in
tests/conftest.py): reused only after a clean shutdown, each reuse a new world, and a job in a reused process
computes exactly what it computes in a fresh one."""
import time
from pathlib import Path
from unittest.mock import ANY

import psutil
import pytest

from hybridflow.config.loader import load_config
from hybridflow.controller import RayWorkerGroup, ResourcePool, WorkerError, keep_processes_warm
from hybridflow.controller import warm_hosts
from hybridflow.trainer import read_metrics
from hybridflow.trainer.trainer import RLTrainer
from tests.controller.workers import Echo
from tests.trainer.test_trainer import in_repo, learned

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]


@pytest.fixture
def fresh():
    """No process kept from an earlier test: the first group of the test starts its own."""
    was = warm_hosts.warm_enabled()
    keep_processes_warm(False)
    keep_processes_warm(True)
    yield
    keep_processes_warm(was)


def _gone(pids: list[int], seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(psutil.pid_exists(pid) for pid in pids)


def test_a_clean_shutdown_hands_the_processes_to_the_next_group_in_a_new_world(fresh):
    first = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"), offset=1)
    pids = first.pids()
    assert first.call(Echo.all_reduce, 1.0) == [3.0, 3.0]  # a gloo world of two is up
    first.shutdown()
    assert warm_hosts.idle_count() == 2
    second = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"), offset=5)
    try:
        assert sorted(second.pids()) == sorted(pids) and warm_hosts.idle_count() == 0
        infos = second.call(Echo.whoami)
        assert [i["rank"] for i in infos] == [0, 1] and all(i["offset"] == 5 for i in infos)
        assert infos[0]["env"]["MASTER_PORT"] == infos[1]["env"]["MASTER_PORT"]
        assert second.call(Echo.all_reduce, 2.0) == [6.0, 6.0]  # the old world was left, a new one joined
        assert second.call(Echo.gather_ranks) == [[0, 1], [0, 1]]
        # The first job's workers were freed, though only the collector could (each is in a reference cycle):
        # the heap frozen at the end of a reset (`ray_group._freeze_heap`) holds no worker.
        assert second.call(Echo.alive_echoes) == [{"alive": 1, "frozen": ANY}] * 2
        assert all(r["frozen"] > 10_000 for r in second.call(Echo.alive_echoes))
    finally:
        second.shutdown()


def test_a_failed_groups_processes_are_killed_not_kept(fresh):
    group = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    pids = group.pids()
    with pytest.raises(WorkerError):
        group.call(Echo.fail_on, 1)
    assert warm_hosts.idle_count() == 0 and _gone(pids)
    after = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    try:
        assert not set(after.pids()) & set(pids)
    finally:
        after.shutdown()


def test_a_process_that_built_a_device_mesh_is_not_kept(fresh):
    """torch's DTensor caches keep device meshes, and a later world's mesh of the same shape compares equal:
    a process reused at another rank took the old coordinate and an FSDP checkpoint came out with its shards
    swapped. Such a process ends with its job (`parallel.process_group.keeps_world_state`)."""
    group = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    pids = group.pids()
    assert group.call(Echo.mesh_coordinate) == [(0,), (1,)]
    group.shutdown()
    assert warm_hosts.idle_count() == 0 and _gone(pids)


def test_processes_of_another_kind_start_beside_the_kept_ones_where_the_cluster_has_room(fresh):
    """A kept process reserved its CPU share at start: a pool asking another share starts its own. The
    session's cluster (8 CPUs) holds both, so the kept ones stay and serve the next group of their kind."""
    whole = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    pids = whole.pids()
    whole.shutdown()
    halves = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu", share={0: 2, 1: 2}))  # devices shared by 2 pools
    try:
        assert not set(halves.pids()) & set(pids) and warm_hosts.idle_count() == 2
        assert halves.call(Echo.all_reduce, 1.0) == [3.0, 3.0]
    finally:
        halves.shutdown()
    again = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    try:
        assert sorted(again.pids()) == sorted(pids) and warm_hosts.idle_count() == 2  # the halves wait now
    finally:
        again.shutdown()


def test_kept_processes_of_another_kind_are_killed_oldest_first_only_until_the_new_ones_fit(fresh):
    """`take` frees CPUs for the processes a group must start by killing kept processes of other kinds,
    oldest first, and only as many as the cluster's free CPUs fall short by."""
    import ray

    whole = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    whole.shutdown()
    deadline = time.monotonic() + 30  # processes `fresh` killed release their reservations a moment later
    while ray.available_resources()["CPU"] != 6.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    free = ray.available_resources()["CPU"]  # the session's 8, less the two kept processes' reservations
    assert free == 6.0
    assert warm_hosts._to_free(free, [1.0, 1.0]) == 0
    assert warm_hosts._to_free(free + 0.5, [1.0, 1.0]) == 1
    assert warm_hosts._to_free(free + 1.5, [1.0, 1.0]) == 2
    assert warm_hosts._to_free(free + 5.0, [1.0, 1.0]) == 2  # all there are: the start waits for the rest


def _fit(tmp_path: Path, *overrides: str) -> tuple[list[int], dict]:
    cfg = in_repo(load_config(ROOT / "configs" / "tiny-grpo.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.n_devices=2", "trainer.launcher=ray", "trainer.total_steps=2",
        "trainer.save_every=0", "data.val_files=[]", *overrides]))
    trainer = RLTrainer(cfg)
    try:
        pids = trainer.actor.group.pids()
        summary = trainer.fit()
    finally:
        trainer.shutdown()
    return pids, learned(read_metrics(summary["run_dir"] / "metrics.jsonl"))


def test_training_in_reused_processes_equals_training_in_fresh_ones_after_another_layout_ran_there(fresh, tmp_path):
    """GRPO at DP2 in fresh processes; then TP2 in the same processes (megatron-core's groups of the first
    job torn down, else the engine refuses a second layout); then DP2 again there. Same computation, same
    process kind: the third run's metrics equal the first's exactly."""
    pids, first = _fit(tmp_path / "a")
    tp_pids, _ = _fit(tmp_path / "b", "actor.parallel.tp=2")
    again_pids, again = _fit(tmp_path / "c")
    assert sorted(tp_pids) == sorted(again_pids) == sorted(pids)
    assert first.keys() == again.keys() and {1, 2} <= first.keys() and first[2]
    for step, values in first.items():
        assert again[step] == values, step
