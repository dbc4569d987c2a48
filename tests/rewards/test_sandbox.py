"""Hostile programs in the code reward's sandbox: each is contained, scores 0, and leaves the machine as it was.

What stops each one is in docs/features.md ("Code in a sandbox"). The limits are small so the tests stay cheap
on a 2-core machine: 1 CPU second, 2 wall seconds, 256 MB, 8 processes, 1 MB files, 64 KB of output.
"""
import json
import os
import socket
import time
from pathlib import Path

import pytest

from hybridflow.config.schema import SandboxConfig
from hybridflow.rewards.code import code_reward
from hybridflow.rewards.sandbox import Sandbox, isolation_problem

REPO = Path(__file__).resolve().parents[2]
PROBLEM = isolation_problem()
LIMITS = SandboxConfig(cpu_s=1, wall_s=2, memory_mb=256, processes=8, file_size_mb=1, output_kb=64,
                       allow_unisolated=PROBLEM is not None)
TESTS = json.dumps({"asserts": ["assert add(1, 2) == 3", "assert add(2, 5) == 7"]})
GOOD = "def add(a, b):\n    return a + b\n"
MARK = "/tmp/hybridflow-sandbox-escape-{}".format(os.getpid())

# name -> a program that tries to break out (each defines a correct add() after its attack, where it can).
HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "infinite loop": "while True:\n    pass\n",
    "memory bomb": "x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n",
    "10 GB file": "with open('big', 'wb') as f:\n    for _ in range(10240):\n        f.write(bytes(1 << 20))\n",
    "reading /etc": "print(open('/etc/passwd').read())\n" + GOOD,
    "reading the repository": f"print(open({str(REPO / 'setup.py')!r}).read())\n" + GOOD,
    "writing outside": f"open({str(REPO / 'escaped.txt')!r}, 'w').write('escaped')\n" + GOOD,
    "writing to /usr": "open('/usr/escaped.txt', 'w').write('escaped')\n" + GOOD,
    "opening a socket": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\n" + GOOD,
    "killing its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)\n",
    "a daemon that outlives it": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1.5)\n"
        f"    open({MARK!r}, 'w').write('daemon')\n    os._exit(0)\n" + GOOD + "import sys\nsys.exit(0)\n"),
    "printing 1 GB": "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))\n" + GOOD,
    "sys.exit(0) before the tests": "import sys\nsys.exit(0)\n",
    "os._exit(0) before the tests": "import os\nos._exit(0)\n",
    "monkey-patching the harness": (
        "import os, sys, atexit\natexit.register(lambda: os._exit(0))\nsys.exit = lambda *a: None\n"
        "os._exit = lambda *a: None\nimport builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
        "main = sys.modules['__main__']\nmain.TESTS = ('pass', 'pass')\nprint('0' * 32 + ' 11')\n"
        "def add(a, b):\n    return 0\n"),
}


def _own_processes() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


@pytest.mark.slow
def test_a_correct_program_passes_so_the_zeros_below_mean_something():
    assert code_reward("c", f"```python\n{GOOD}```", TESTS, None, limits=LIMITS) == 1.0
    wrong = GOOD.replace("a + b", "a - b")
    assert code_reward("c", wrong, TESTS, None, limits=LIMITS) == 0.0


@pytest.mark.slow
def test_isolation_is_available_or_the_reason_is_explicit():
    """CI machines are like this one: namespaces must work here; elsewhere this test and the hostile ones below
    are skipped, naming why (a hostile program with limits only would reach the machine)."""
    if PROBLEM is not None:
        pytest.skip(f"namespaces unavailable, hostile programs ran with rlimits only: {PROBLEM}")
    result = Sandbox(LIMITS).run({"main.py": "import os\nprint(os.listdir('/'), os.path.exists('/etc'))"})
    assert result.ok and "'usr'" in result.stdout and result.stdout.rstrip().endswith("False")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_program_is_contained_and_scores_0(name, tmp_path):
    if PROBLEM is not None:  # never run them with limits only: they would reach this machine (kill the test run)
        pytest.skip(f"namespaces unavailable, hostile programs not run: {PROBLEM}")
    before, private = _own_processes(), set(Path("/tmp").glob("hybridflow-sandbox-*"))
    started = time.monotonic()
    assert code_reward("c", HOSTILE[name], TESTS, None, limits=LIMITS) == 0.0
    assert time.monotonic() - started < 3 * LIMITS.wall_s + 5
    time.sleep(0.1)
    if name == "a daemon that outlives it":
        time.sleep(2)  # past the daemon's own sleep: had it survived, it would have written MARK by now
    assert not os.path.exists(MARK), "the program wrote outside its directory"
    assert not (REPO / "escaped.txt").exists() and not os.path.exists("/usr/escaped.txt")
    assert set(Path("/tmp").glob("hybridflow-sandbox-*")) <= private, "a private directory was left behind"
    left = {pid for pid in _own_processes() - before if _is_child_of_test(pid)}
    assert not left, f"processes left behind: {left}"


def _is_child_of_test(pid: int) -> bool:
    """Whether `pid` still runs as a descendant of this test process (a sandbox remnant)."""
    try:
        while pid > 1:
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            if pid == os.getpid():
                return True
    except (OSError, StopIteration):
        return False
    return False


@pytest.mark.slow
def test_the_network_is_absent_and_files_are_private_inside():
    if PROBLEM is not None:
        pytest.skip(f"namespaces unavailable: {PROBLEM}")
    program = ("import os, socket\ntry:\n    socket.create_connection(('127.0.0.1', PORT), timeout=1)\n"
               "    print('reached')\nexcept OSError as e:\n    print('no network', e.errno)\n"
               "print(os.path.exists(REPO), os.getuid())\n")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        program = program.replace("PORT", str(server.getsockname()[1])).replace("REPO", repr(str(REPO)))
        result = Sandbox(LIMITS).run({"main.py": program})
    finally:
        server.close()
    assert result.ok and "no network" in result.stdout and "reached" not in result.stdout
    assert result.stdout.rstrip().endswith("False 65534")
