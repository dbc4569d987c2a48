"""RayWorkerGroup: SPMD workers as Ray actors, dispatch modes end to end, and failures that surface."""
import os
import signal
import threading
import time

import pytest
import torch

from hybridflow.controller import Dispatch, RayWorkerGroup, ResourcePool, WorkerError, register
from hybridflow.controller.worker import Worker
from tests.controller.workers import BrokenInit, Echo, double_batch

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def echo_group(ray_cluster):
    group = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"), offset=7)
    yield group
    group.shutdown()


def _batch(n=8):
    return {"x": torch.arange(n * 14, dtype=torch.int64).reshape(n, 14), "names": [f"q{i}" for i in range(n)]}


def test_workers_get_their_context_before_init(echo_group):
    infos = echo_group.call(Echo.whoami)
    assert [i["rank"] for i in infos] == [0, 1] and [i["init_rank"] for i in infos] == [0, 1]
    assert all(i["world"] == 2 and i["offset"] == 7 for i in infos)
    env0, env1 = infos[0]["env"], infos[1]["env"]
    assert (env0["RANK"], env1["RANK"], env1["WORLD_SIZE"]) == ("0", "1", "2")
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] and env0["MASTER_PORT"] == env1["MASTER_PORT"]
    assert env0["CUDA_VISIBLE_DEVICES"] == "" and {env0["LOCAL_RANK"], env1["LOCAL_RANK"]} == {"0", "1"}
    assert not hasattr(echo_group, "not_exposed")


def test_gloo_group_all_reduce(echo_group):
    # rank r contributes 3 * (r + 1): 3 + 6
    assert echo_group.call(Echo.all_reduce, 3.0) == [9.0, 9.0]
    assert echo_group.call(Echo.gather_ranks) == [[0, 1], [0, 1]]


def _listening_addresses(pids: set[int]) -> list[tuple[int, str, int]]:
    import psutil

    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def test_nothing_the_run_started_listens_beyond_loopback(echo_group):
    """#13: the local Ray cluster (GCS, raylet, workers, agents), the workers' gloo group and its store,
    and this process's own world of one listen on loopback only, while a 2-rank group is alive."""
    import psutil

    from hybridflow.parallel.process_group import init_process_group, is_loopback

    init_process_group("cpu")
    assert echo_group.call(Echo.all_reduce, 3.0) == [9.0, 9.0]  # the gloo group is up on both ranks
    me = psutil.Process()
    tree = {me.pid} | {p.pid for p in me.children(recursive=True)}
    workers = set(echo_group.pids())
    assert workers <= tree  # the actors are in the tree whose sockets are checked
    listening = _listening_addresses(tree)
    names = {psutil.Process(pid).name() for pid, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names and workers & {pid for pid, _, _ in listening}
    assert [entry for entry in listening if not is_loopback(entry[1])] == []


def test_the_local_cluster_refuses_a_client_without_its_token(ray_cluster):
    """#13: loopback is not the only guard (another user of the machine reaches it): the local
    cluster runs with Ray's token auth, so a driver holding a wrong token cannot join."""
    import subprocess
    import sys

    gcs = ray_cluster.get_runtime_context().gcs_address
    # Two connection attempts instead of Ray's 20 (one a second): the refusal comes on the first.
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token", RAY_gcs_server_port_wait_time_s="2")
    out = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r})"], env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode != 0 and "InvalidAuthToken" in out.stderr


def test_a_full_disk_on_a_ray_worker_is_one_line_naming_the_file(ray_cluster):
    """#13 item 7: the worker's traceback travels as text; its OSError's errno and file travel beside it,
    so the CLI says "No space left on device" and names the file, not the worker's traceback."""
    from hybridflow.cli import _disk_error

    group = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    with pytest.raises(WorkerError) as info:
        group.call(Echo.write_to_a_full_disk, "/ckpt/step_000003/model.bin")
    group.shutdown()
    assert info.value.os_error[0] == 28 and info.value.os_error[2] == "/ckpt/step_000003/model.bin"
    assert _disk_error(info.value) == ("No space left on device: /ckpt/step_000003/model.bin "
                                       "(in the directory /ckpt/step_000003)")


def test_dp_split_round_trip_in_order(echo_group):
    batch = _batch()
    out = echo_group.call(Echo.double, batch, extra=1)
    want = double_batch(batch)
    assert torch.equal(out["x"], want["x"] + 1) and out["names"] == want["names"]
    assert out["rank"] == [0] * 4 + [1] * 4


def test_dp_split_ships_declared_fields_pads_uneven_batches_and_strips_the_padding(echo_group):
    """A method registered with reads=... receives only those fields; 3 rows over 2 ranks are padded to 4
    (the last row repeated) and the answer holds the 3 real rows; each call's tensor bytes are counted."""
    batch = {"x": torch.arange(3.0), "names": ["a", "b", "c"], "unused": torch.zeros(3, 1000)}
    before = echo_group.shipped_bytes
    out = echo_group.call(Echo.double_read, batch)
    assert out["x"].tolist() == [0.0, 2.0, 4.0] and out["names"] == ["A", "B", "C"]
    assert out["fields"] == [["names", "x"]] * 3
    assert echo_group.shipped_bytes - before == 4 * 4  # 4 float32 rows of x; "unused" never left
    out = echo_group.call(Echo.double, {"x": torch.arange(5.0), "names": list("abcde")})
    assert out["names"] == list("ABCDE") and out["rank"] == [0, 0, 0, 1, 1]


def test_per_replica_arguments_reach_their_replica_as_they_are(echo_group):
    from hybridflow.controller.dispatch import PerReplica

    rows = PerReplica([{"names": ["a", "b", "c"]}, {"names": ["d"]}])  # shares of unequal size
    out = echo_group.call(Echo.share, rows, PerReplica([[0, 1], [2]]))
    assert out == {"names": [["a", "b", "c"], ["d"]], "steps": [[0, 1], [2]]}
    with pytest.raises(ValueError, match="holds 1 values for 2 replicas"):
        echo_group.call(Echo.share, PerReplica([{"names": ["a"]}]), [0])


@pytest.mark.parametrize("lane", [True, False], ids=["aside-lane", "one-lane"])
def test_an_aside_method_runs_while_the_worker_is_busy_with_another_call(ray_cluster, tmp_path, lane):
    """`register(aside=True)` in a group started `with_aside_lane`: the call runs on the actor's second
    thread, beside the call in progress (the weight broadcast of a staged copy while the actor trains).
    In a group without the lane it runs in line: `release` queues behind `hold`, which waits for it until
    its 3 s run out (as it would on a GPU pool, `uses_aside_lane`)."""
    from concurrent.futures import ThreadPoolExecutor

    from hybridflow.controller.ray_group import uses_aside_lane

    assert uses_aside_lane("cpu") and not uses_aside_lane("cuda")
    start = RayWorkerGroup.with_aside_lane if lane else RayWorkerGroup
    group = start(Echo, ResourcePool([0, 1], "cpu"))
    flag = str(tmp_path / "released")
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(group.call, Echo.hold, flag, 3.0)
            time.sleep(0.5)  # `hold` is in progress on every rank
            assert len(set(group.call(Echo.release, flag))) == 2  # both ranks' processes
            waited = max(held.result(timeout=30))
        assert (waited < 2.5) is lane, waited
    finally:
        group.shutdown()


def test_one_to_all_rank_zero_all_to_all(echo_group):
    assert echo_group.call(Echo.tag) == "rank0"
    assert echo_group.call(Echo.add, [1, 2], b=[10, 20]) == [11, 122]
    with pytest.raises(ValueError, match="one value per rank"):
        echo_group.call(Echo.add, [1, 2, 3])
    assert echo_group.alive  # a bad call on the controller side does not touch the workers


def test_worker_exception_surfaces_with_rank_method_and_traceback(ray_cluster):
    group = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    with pytest.raises(WorkerError) as err:
        group.call(Echo.fail_on, 1)
    text = str(err.value)
    assert err.value.rank == 1 and err.value.method == "fail_on"
    assert "ValueError: bad value on rank 1" in text and "_raise_from_worker" in text
    assert not group.alive
    with pytest.raises(WorkerError, match="shut down after that failure"):
        group.call(Echo.tag)


def test_worker_init_failure_surfaces(ray_cluster):
    with pytest.raises(WorkerError) as err:
        RayWorkerGroup(BrokenInit, ResourcePool([0, 1], "cpu"))
    assert err.value.rank == 1 and err.value.method == "__init__"
    assert "cannot build the model on this rank" in str(err.value)


def test_worker_exiting_mid_collective_is_reported_without_hang(ray_cluster):
    group = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        group.call(Echo.exit_on, 1)  # rank 0 is left waiting in a barrier
    assert err.value.rank == 1 and "died" in str(err.value)
    assert time.monotonic() - start < 60 and not group.alive


def test_worker_killed_mid_call_is_reported_within_timeout(ray_cluster):
    group = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    pids = group.pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    killer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed in sleep"):
        group.call(Echo.sleep, 60)
    killer.join()
    assert time.monotonic() - start < 45


def test_call_timeout_tears_down_a_hung_group(ray_cluster):
    group = RayWorkerGroup(Echo, ResourcePool([0], "cpu"))
    group.call_timeout = 1.0
    with pytest.raises(WorkerError, match=r"rank\(s\) \[0\] did not answer within 1.0s"):
        group.call(Echo.sleep, 30)
    assert not group.alive


def test_group_rejects_non_workers_and_oversized_pools(ray_cluster):
    class Plain:
        pass

    with pytest.raises(TypeError, match="subclasses of Worker"):
        RayWorkerGroup(Plain, ResourcePool([0]))
    with pytest.raises(RuntimeError, match="needs 20 logical CPUs but the Ray cluster has 8"):
        RayWorkerGroup(Echo, ResourcePool(list(range(20))))


@pytest.mark.parametrize("colocated", [False, True], ids=["one-group", "colocated-groups"])
def test_calls_from_two_threads_reach_every_rank_in_one_order(echo_group, monkeypatch, colocated):
    """The async DataFlow calls one group from several threads (rollout of one chunk, log-probs of the
    previous). Each call's collectives pair up across ranks only if every rank runs the calls in the
    same order: a call is submitted to all ranks before another call's submissions start. Here one
    thread pauses between its rank-0 and rank-1 submissions while the other submits to both: to the same
    group, or to a group colocated in its processes (the critic in the actor's)."""
    from hybridflow.controller import ray_group as wg

    group = echo_group
    other = RayWorkerGroup.colocated(group, Echo) if colocated else group
    monkeypatch.setattr(group, "call_timeout", 20.0)
    other.call_timeout = 20.0
    flatten, paused = wg._flatten, threading.Event()

    def slow_flatten(args, kwargs):
        if threading.current_thread().name == "slow" and not paused.is_set() and args == (1.0,) and \
                getattr(slow_flatten, "seen", 0) == 1:
            paused.set()
            time.sleep(0.5)  # the other thread's whole call goes out now, unless it must wait
        slow_flatten.seen = getattr(slow_flatten, "seen", 0) + (threading.current_thread().name == "slow")
        return flatten(args, kwargs)

    monkeypatch.setattr(wg, "_flatten", slow_flatten)
    results = {}
    slow = threading.Thread(target=lambda: results.update(slow=group.call(Echo.all_reduce, 1.0)), name="slow")
    try:
        slow.start()
        assert paused.wait(10)
        results["fast"] = other.call(Echo.gather_ranks)
        slow.join(30)
        assert results == {"slow": [3.0, 3.0], "fast": [[0, 1], [0, 1]]}
    finally:
        if colocated:
            other.shutdown()
    assert echo_group.alive and echo_group.call(Echo.tag) == "rank0"  # the module's group goes on


@pytest.fixture
def cold(ray_cluster):
    """Processes end with their last group, as outside the test session (`keep_processes_warm` off)."""
    from hybridflow.controller import keep_processes_warm
    from hybridflow.controller.warm_hosts import warm_enabled

    was = warm_enabled()
    keep_processes_warm(False)
    yield
    keep_processes_warm(was)


def test_a_colocated_group_runs_in_the_same_processes_and_outlives_the_first_shutdown(cold):
    """`RayWorkerGroup.colocated`: a second role's workers in the first group's processes, rank for rank,
    in the same torch.distributed world. The processes end with the last group on them."""
    import psutil

    first = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"), offset=1)
    second = RayWorkerGroup.colocated(first, Echo, offset=2)
    try:
        pids = first.pids()
        assert second.pids() == pids
        assert [i["offset"] for i in first.call(Echo.whoami)] == [1, 1]
        assert [i["offset"] for i in second.call(Echo.whoami)] == [2, 2]  # each group its own worker
        assert first.call(Echo.all_reduce, 1.0) == [3.0, 3.0] and second.call(Echo.all_reduce, 2.0) == [6.0, 6.0]
        first.shutdown()
        assert not first.alive and second.alive
        assert second.call(Echo.gather_ranks) == [[0, 1], [0, 1]]
        assert all(psutil.pid_exists(pid) for pid in pids)
    finally:
        first.shutdown()
        second.shutdown()
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_a_failure_in_a_colocated_group_stops_both(ray_cluster):
    first = RayWorkerGroup(Echo, ResourcePool([0, 1], "cpu"))
    second = RayWorkerGroup.colocated(first, Echo)
    try:
        with pytest.raises(WorkerError, match="rank 1 failed in fail_on"):
            second.call(Echo.fail_on, 1)
        assert not first.alive and not second.alive
        with pytest.raises(WorkerError, match="shut down after that failure: ValueError: bad value on rank 1"):
            first.call(Echo.tag)
    finally:
        first.shutdown()
        second.shutdown()


def test_a_group_failing_before_a_rendezvous_it_serves_ends_the_other_sides_wait(ray_cluster):
    """Two groups meeting in one rendezvous (as the actor's and a rollout group apart do for the weight sync):
    the serving side fails before it serves, and the other, waiting to connect (for up to 30 minutes), is
    torn down after `run_together`'s grace instead. The raised error is the failure, not the teardown."""
    from hybridflow.controller.group import run_together
    from tests.controller.workers import Meeting

    serving = RayWorkerGroup(Meeting, ResourcePool([0], "cpu"))
    waiting = RayWorkerGroup(Meeting, ResourcePool([1], "cpu"))
    try:
        (address, port), = serving.call(Meeting.serve_address)
        assert run_together(lambda: serving.call(Meeting.meet, address, port, 0, 2),
                            lambda: waiting.call(Meeting.meet, address, port, 1, 2)) == [[0], [1]]  # they meet
        (address, port), = serving.call(Meeting.serve_address)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="failed in fail: ValueError: failed before serving"):
            run_together(lambda: serving.call(Meeting.fail), lambda: waiting.call(Meeting.meet, address, port, 1, 2),
                         abort=(serving, waiting), grace_s=1.0)
        assert time.monotonic() - start < 60
        with pytest.raises(WorkerError, match="a group it met in one collective failed first"):
            waiting.call(Meeting.meet, address, port, 1, 2)
    finally:
        serving.shutdown()
        waiting.shutdown()
