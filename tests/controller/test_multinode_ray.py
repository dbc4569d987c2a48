"""A Ray cluster of two nodes on one machine: `hybridflow train ... trainer.ray_address=...` uses both, and a
node that disappears mid-run is named in the error (issue 31, item 3).

The cluster is started as a user starts one: `ray start --head` and `ray start --address HEAD` (each node
its own raylet and object store), one logical CPU per node, so the two one-CPU ranks of the run cannot
share a node. Each node gets its own loopback address (127.0.0.2 head, 127.0.0.3 second node: addresses
other than 127.0.0.1 are not rewritten by Ray to the machine's outward address) and its own ports, under a
temp dir of this module's own; Ray's control plane requires the token (RAY_AUTH_MODE=token, SECURITY.md).
Other Ray sessions run on this machine at the same time, so nothing here calls `ray stop`: the fixture
kills the process groups it started and every process whose command line names its temp dir.

The driver is `python -m hybridflow.cli train` in a process of its own (this test process may already hold
the session's local Ray cluster, and a process joins one cluster at a time).
"""
import contextlib
import json
import os
import re
import shutil
import signal
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hybridflow.trainer import read_metrics
from tests.trainer.test_distributed_trainer import _assert_same_metrics, run

ROOT = Path(__file__).resolve().parents[2]
HEAD_IP, SECOND_IP = "127.0.0.2", "127.0.0.3"
START_TIMEOUT_S = 90.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
TWO_STEPS = ["trainer.total_steps=2", "trainer.save_every=0", "data.val_files=[]"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodeCluster:
    """`ray start --block` twice, each in a process group of its own; `address` is the head's GCS."""

    def __init__(self, temp_dir: str):
        self.temp_dir = temp_dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        # The cluster's own token, in the environment its nodes and the driver share: ~/.ray/auth_token
        # exists only once some local ray.init wrote it (this file alone, on a fresh machine, had none).
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
                        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
        self.ports: set[int] = set()  # handed out to this cluster's components
        self.address = f"{HEAD_IP}:{self._port()}"
        self.starters: list[subprocess.Popen] = []

    def _port(self) -> int:
        """A port free now and not yet given to another of this cluster's components: each probe's socket is
        closed before the next, so the OS may offer one port twice (seen: the GCS and the client server both
        got 53465, and `ray start` refused)."""
        while (port := _free_port()) in self.ports:
            pass
        self.ports.add(port)
        return port

    def start(self) -> None:
        port = self.address.rsplit(":", 1)[1]
        self._node(HEAD_IP, "head", ["--head", "--port", port, "--temp-dir", self.temp_dir,
                                     "--include-dashboard", "false", "--ray-client-server-port", str(self._port())])
        self._node(SECOND_IP, "second", ["--address", self.address])

    def _node(self, ip: str, name: str, role_args: list[str]) -> None:
        """One node; returns once `ray start` says it runs (the raylet has registered with the GCS)."""
        ports = {"--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"}
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--node-ip-address", ip,
               "--num-cpus", "1", "--object-store-memory", str(100 * 1024 ** 2), "--disable-usage-stats",
               "--include-log-monitor", "false", "--resources", json.dumps({f"node_{name}": 1}), *role_args]
        for flag in sorted(ports):
            cmd += [flag, str(self._port())]
        log = Path(self.temp_dir) / f"start_{name}.log"
        with open(log, "w") as out:
            self.starters.append(subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text():
            if self.starters[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start ({name}) did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def raylet(self, ip: str):
        """(psutil process, Ray node id) of the raylet serving `ip`."""
        import psutil

        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if cmd and cmd[0].endswith("/raylet") and self.temp_dir in " ".join(cmd) \
                    and f"--node_ip_address={ip}" in cmd:
                node_id = next(arg.split("=", 1)[1] for arg in cmd if arg.startswith("--node_id="))
                return proc, node_id
        raise LookupError(f"no raylet for {ip} under {self.temp_dir}")

    def stop(self) -> None:
        """Kill what this cluster started, and only that: its process groups, then any process whose
        command line names the cluster's temp dir (workers the raylets started)."""
        import psutil

        for starter in self.starters:
            try:
                os.killpg(starter.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            starter.wait(timeout=30)
        for proc in psutil.process_iter(["cmdline"]):
            if self.temp_dir in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                try:
                    proc.kill()
                except psutil.Error:
                    pass


@pytest.fixture(scope="module")
def two_nodes():
    # Short: Ray's unix sockets live under it and their paths are limited to ~107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="hf2n", dir="/tmp")
    cluster = TwoNodeCluster(temp_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def _train(cluster: TwoNodeCluster, out: Path, *overrides: str):
    """`hybridflow train` of tiny-ppo (actor and critic at DP2, two Ray processes) joining `cluster`; a driver
    still running when the block ends (a failed assertion, a timeout) is killed."""
    driver = subprocess.Popen(
        [sys.executable, "-m", "hybridflow.cli", "train", "configs/tiny-ppo.yaml", f"trainer.output_dir={out}",
         f"trainer.ray_address={cluster.address}", "trainer.n_devices=2", "trainer.launcher=ray", *overrides],
        cwd=ROOT, env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield driver
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate(timeout=30)


def _placement(log: str, role: str) -> dict[int, tuple[str, str]]:
    """rank -> (node id, IP) from the driver's placement lines (ray_nodes.log_placement)."""
    found = {}
    for ranks, node_id, ip in re.findall(rf"{role}: rank\(s\) \[([\d, ]+)\] on node (\w+) \(([\d.]+)\)", log):
        for rank in ranks.split(","):
            found[int(rank)] = (node_id, ip)
    return found


def _logged_steps(metrics: Path) -> set[int]:
    """Steps whose line is complete in a metrics file that is still being written."""
    steps = set()
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            steps.add(json.loads(line)["step"])
        except ValueError:  # the line being written
            pass
    return steps


def test_ppo_on_a_two_node_ray_cluster_uses_both_nodes_and_matches_one_process(two_nodes, tmp_path):
    """Two PPO steps through `trainer.ray_address`: one rank lands on each node (each has one CPU; which
    rank goes where is Ray's choice, seen both ways in CI), and the metrics equal the one-process run to
    1e-5 (as the torchrun two-node test)."""
    with _train(two_nodes, tmp_path / "nodes", *TWO_STEPS) as driver:
        _, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, err[-3000:]
    head_id, second_id = two_nodes.raylet(HEAD_IP)[1], two_nodes.raylet(SECOND_IP)[1]
    for role in ("ActorRolloutRefWorker", "CriticWorker"):  # the critic shares the actor's processes
        placed = _placement(err, role)
        assert sorted(placed) == [0, 1], (role, err[-3000:])
        assert sorted(placed.values()) == sorted([(head_id, HEAD_IP), (second_id, SECOND_IP)]), (role, err[-3000:])
    # The critic shares the actor's processes, so each rank is on the same node in both roles.
    assert _placement(err, "CriticWorker") == _placement(err, "ActorRolloutRefWorker")
    records = read_metrics(tmp_path / "nodes" / "tiny-ppo" / "metrics.jsonl")
    _, one = run("tiny-ppo.yaml", tmp_path / "one", *TWO_STEPS)
    _assert_same_metrics({"one": one, "two nodes": records}, (1, 2), rel=1e-5)


def test_a_node_lost_mid_run_is_named_in_the_error(two_nodes, tmp_path):
    """SIGKILL the second node's raylet once step 1 is logged: Ray takes that node's worker down, the
    run stops with an error naming the node (id and IP) and the ranks and roles it held (the rank Ray put
    there, read from the driver's placement lines), and the driver exits instead of hanging (the bound is
    the communicate timeout, not a timed assertion)."""
    out = tmp_path / "lost"
    metrics = out / "tiny-ppo" / "metrics.jsonl"
    with _train(two_nodes, out, "trainer.total_steps=50", "trainer.save_every=0", "data.val_files=[]") as driver:
        deadline = time.monotonic() + 240
        while 1 not in _logged_steps(metrics):
            assert driver.poll() is None, driver.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "step 1 was not logged"
            time.sleep(0.5)
        raylet, second_id = two_nodes.raylet(SECOND_IP)
        raylet.kill()
        _, err = driver.communicate(timeout=120)
    assert driver.returncode == 1, err[-3000:]
    error = err[err.index("hybridflow: error:"):]
    assert f"node {second_id} ({SECOND_IP}) left the Ray cluster" in error, error[-3000:]
    on_second = [rank for rank, (node, _) in sorted(_placement(err, "ActorRolloutRefWorker").items())
                 if node == second_id]
    assert len(on_second) == 1, err[-3000:]
    assert f"it held rank(s) {on_second} of ActorRolloutRefWorker, CriticWorker" in error, error[-3000:]
    assert two_nodes.raylet(HEAD_IP)[1] not in error  # the head is not blamed
