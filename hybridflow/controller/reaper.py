"""Reap a local Ray cluster whose driver died without shutting it down (kill -9, OOM killer).

Ray ties its GCS and raylet to the driver (they die with it), and the
workers follow the raylet, but the dashboard and runtime-env agents first
try to report the raylet's death to the dead GCS and linger for about a
minute. `start(driver_pid)` launches this file as a small process of its own
(no hybridflow or torch import: psutil only) that keeps a list of the
driver's descendants, refreshed every second, and learns of the driver's
death at once from the pipe the driver holds (EOF when it exits, however it
exits). It then kills every process on its list that is still the same
process (pid and start time), and exits.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

REFRESH_S = 1.0


def start(driver_pid: int) -> subprocess.Popen:
    """Launch the reaper for `driver_pid` (this process); it outlives it only long enough to reap."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(driver_pid)], stdin=read_end,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
    os.close(read_end)
    os.set_inheritable(write_end, False)  # only the driver holds it: children must not keep the reaper waiting
    proc._driver_pipe = write_end  # held open for the driver's lifetime, closed by its exit
    return proc


def _descendants(pid: int) -> dict[int, float]:
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    seen = {}
    for p in procs:
        try:
            seen[p.pid] = p.create_time()
        except psutil.Error:
            pass
    return seen


def _reap(known: dict[int, float]) -> None:
    import psutil

    for pid, created in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def main(driver_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's business
    known: dict[int, float] = {}
    while True:
        known.update(_descendants(driver_pid))
        ready, _, _ = select.select([sys.stdin], [], [], REFRESH_S)
        if ready and not os.read(sys.stdin.fileno(), 1):  # EOF: the driver is gone
            break
    known.pop(os.getpid(), None)
    _reap(known)


if __name__ == "__main__":
    main(int(sys.argv[1]))
