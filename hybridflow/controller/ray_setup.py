"""Start (or join) Ray for the single controller, with settings that work on small machines.

On a 2-core laptop or CI box Ray's defaults get in the way: it counts 2 CPUs,
so a third 1-CPU actor waits forever; it sizes the object store from RAM; it
starts a dashboard and asks about usage statistics. `init_ray()` declares
more logical CPUs than cores (actors here mostly wait on each other in
collectives), an explicit object store, no dashboard and quiet logging.
Joining an existing cluster (`address=...`) uses that cluster's resources.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

DEFAULT_OBJECT_STORE_BYTES = 256 * 1024 ** 2
MIN_LOGICAL_CPUS = 8  # so 4 one-CPU actors (plus Ray's own tasks) fit on 2 cores


def init_ray(address: Optional[str] = None, num_cpus: Optional[int] = None,
             object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES, num_gpus: Optional[int] = None) -> None:
    """Initialise Ray once per process; later calls (and a Ray already started) are no-ops.

    address: a running cluster ("auto" or "host:port") to join; None starts a
        local one with `num_cpus` logical CPUs (default max(8, cores)),
        `num_gpus` (default: what Ray detects) and `object_store_memory` bytes.
    """
    # Before `import ray`: both are read when Ray starts its processes, which
    # inherit this environment.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    quiet = dict(logging_level=logging.WARNING, configure_logging=True, log_to_driver=True)
    if address is not None:
        ray.init(address=address, **quiet)
        return
    ray.init(num_cpus=num_cpus or max(MIN_LOGICAL_CPUS, os.cpu_count() or 1), num_gpus=num_gpus,
             object_store_memory=object_store_memory, include_dashboard=False, **quiet)
