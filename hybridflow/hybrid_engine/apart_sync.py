"""The actor's weights into a rollout group apart, by collectives: the driver's side of it (the strategies of
`rollout_weights.py` call it; the ranks' side is `worker_weights.py`).

    sync = ApartWeightSync(actor_group, rollout_group, train_layout, tg, bucket_bytes)   # once
    metrics = sync.push()                                                                # after each update
    sync.stage(v); sync.push(v)       # off-policy: a snapshot of version v, broadcast when the rollout takes it

`__init__` asks training rank 0 for an address (its group's master address,
a free port), then both groups join one process group at that store
(`hybrid_engine/weight_sync.py`): their calls must be in flight together,
so the driver issues them from two threads (`controller.run_together`).
`push` does the same with the send and the receive. What crosses the driver
is the address and per-rank figures, never a weight (`shipped_bytes` of
both calls is 0: tested).
"""
from __future__ import annotations

import time
from typing import Optional

from hybridflow.controller.group import run_together
from hybridflow.parallel.layout import ParallelDims


class ApartWeightSync:
    def __init__(self, actor, rollout, train: ParallelDims, tg: int, bucket_bytes: int, virtual_pp: int = 1,
                 ep: int = 1):
        self.actor, self.rollout, self.train = actor, rollout, train
        # torn down when the other side fails: one that fails before the rendezvous (or a broadcast) would
        # leave the other waiting for it (30 min)
        self.groups = (actor.group, rollout.group)
        address, port = actor.sync_address()
        run_together(lambda: actor.join_weight_sync(address, port, tg, rollout.world_size, bucket_bytes),
                     lambda: rollout.join_weight_sync(address, port, train, bucket_bytes, virtual_pp, ep),
                     abort=self.groups)
        self.last: dict = {}  # the last push's per-rank figures (sent: training ranks, received: rollout ranks)

    def stage(self, version: int) -> None:
        """The actor's ranks keep a copy of their weights now as `version`, for a later `push(version)`."""
        self.actor.stage_weights(version)

    def push(self, version: Optional[int] = None) -> dict[str, float]:
        """One sync, of the actor's weights now or of the copy staged as `version`; the `sync/*` figures:
        bytes per receiving rank (the most any received, and the plan's and the formula's for it), bytes every
        training rank sent together, the most collectives one rank joined, and the wall time of the push."""
        start = time.perf_counter()
        send = self.actor.send_weights if version is None else lambda: self.actor.send_staged(version)
        sent, received = run_together(send, self.rollout.receive_weights, abort=self.groups)
        seconds = time.perf_counter() - start
        self.last = {"sent": sent, "received": received}
        out = {"sync/bytes_received": max(r["sync/bytes_received"] for r in received),
               "sync/plan_bytes_received": max(r["sync/plan_bytes_received"] for r in received),
               "sync/formula_bytes_received": max(r["sync/formula_bytes_received"] for r in received),
               "sync/bytes_sent": sum(s["sync/bytes_sent"] for s in sent),
               "sync/plan_bytes_sent": sum(s["sync/plan_bytes_sent"] for s in sent),
               "sync/collectives": max(x["sync/collectives"] for x in (*sent, *received)),
               # every rank joined exactly its planned collectives (0 when none differs)
               "sync/collectives_off_plan": float(sum(x["sync/collectives"] != x["sync/plan_collectives"]
                                                      for x in (*sent, *received))),
               "sync/time_s": seconds}
        if "lora/adapter_bytes_received" in received[0]:  # a LoRA actor's sync (`lora_sync.py`)
            out["lora/adapter_bytes_received"] = max(r["lora/adapter_bytes_received"] for r in received)
            out["lora/adapter_bytes_sent"] = sum(s["lora/adapter_bytes_sent"] for s in sent)
        push = [r["reshard/push_bytes"] for r in received if "reshard/push_bytes" in r]
        if push:  # an engine with its own copy (vLLM) took the received shard by a push
            out["sync/push_bytes"] = max(push)
        return out
