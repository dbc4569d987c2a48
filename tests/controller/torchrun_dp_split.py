"""Run by test_local.py under `torchrun --nproc-per-node 2`: every rank drives a LocalWorkerGroup (SPMD controller)."""
import json

import torch

from hybridflow.controller import LocalWorkerGroup, ResourcePool
from tests.controller.workers import Echo

if __name__ == "__main__":
    group = LocalWorkerGroup(Echo, ResourcePool([0, 1], "cpu"), offset=3)
    batch = {"x": torch.arange(8 * 14, dtype=torch.int64).reshape(8, 14), "names": [f"q{i}" for i in range(8)]}
    out = group.call(Echo.double, batch, extra=1)
    report = {
        "rank": group.rank,
        "x": out["x"].tolist(), "names": out["names"], "row_rank": out["rank"],
        "whoami": [(i["rank"], i["world"], i["offset"]) for i in group.call(Echo.whoami)],
        "tag": group.call(Echo.tag),
        "add": group.call(Echo.add, [1, 2], b=[10, 20]),
        "all_reduce": group.call(Echo.all_reduce, 3.0),
        "gather_ranks": group.call(Echo.gather_ranks),
    }
    group.shutdown()
    if report["rank"] == 0:
        print("RESULT " + json.dumps(report), flush=True)
