"""Start (or join) Ray for the single controller, with settings that work on small machines.

On a 2-core laptop or CI box Ray's defaults get in the way: it counts 2 CPUs,
so a third 1-CPU actor waits forever; it sizes the object store from RAM; it
starts a dashboard and asks about usage statistics. `init_ray()` declares
more logical CPUs than cores (actors here mostly wait on each other in
collectives), an explicit object store, no dashboard and quiet logging.
Joining an existing cluster (`address=...`) uses that cluster's resources.

A local cluster is private: every server it starts (GCS, raylet, object
manager, workers, agents) binds to 127.0.0.1, and its control plane requires
Ray's token (`RAY_AUTH_MODE=token`; ray.init writes the token to
~/.ray/auth_token). Loopback comes from Ray's own single-machine mode
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, what Ray does on macOS and Windows):
the node address is then 127.0.0.1 and Ray binds its servers to it. A
cluster joined by address keeps its own settings (SECURITY.md).

A local cluster is also reaped when this process dies without shutting it
down (kill -9): see reaper.py.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from hybridflow.controller import reaper

DEFAULT_OBJECT_STORE_BYTES = 256 * 1024 ** 2
MIN_LOGICAL_CPUS = 8  # so 4 one-CPU actors (plus Ray's own tasks) fit on 2 cores
_REAPER = None  # kills what the local cluster leaves behind if this process dies unannounced (reaper.py)
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": the node address is 127.0.0.1


def init_ray(address: Optional[str] = None, num_cpus: Optional[int] = None,
             object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES, num_gpus: Optional[int] = None) -> None:
    """Initialise Ray once per process; later calls (and a Ray already started) are no-ops.

    address: a running cluster ("auto" or "host:port") to join; None starts a
        local one with `num_cpus` logical CPUs (default max(8, cores)),
        `num_gpus` (default: what Ray detects) and `object_store_memory` bytes.
    """
    # Before `import ray`: these are read when Ray starts its processes, which
    # inherit this environment.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    imported_before = "ray" in sys.modules
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
    import ray

    if ray.is_initialized():
        return
    quiet = dict(logging_level=logging.WARNING, configure_logging=True, log_to_driver=True)
    if address is not None:
        ray.init(address=address, **quiet)
        return
    if imported_before:
        _reread_settings()
    ray.init(num_cpus=num_cpus or max(MIN_LOGICAL_CPUS, os.cpu_count() or 1), num_gpus=num_gpus,
             object_store_memory=object_store_memory, include_dashboard=False, **quiet)
    global _REAPER
    if _REAPER is None or _REAPER.poll() is not None:
        _REAPER = reaper.start(os.getpid())


def _reread_settings() -> None:
    """This process read Ray's settings when `ray` was first imported, which may have been
    before init_ray (a test session, a user's script); the processes Ray starts read them
    from the environment set above. Make this process agree: its node address on loopback,
    its client sending the auth token."""
    from ray._private import ray_constants
    from ray._raylet import Config

    if os.environ.get(LOOPBACK_ONLY_ENV) == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")  # re-reads RAY_AUTH_MODE, as ray.init does when it turns token auth on
