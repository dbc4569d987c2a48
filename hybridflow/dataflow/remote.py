"""Placing a DataFlow's nodes in their own processes: one Ray worker per node.

    result = flow.run(prompts, launcher="ray")

Each node's model and `forward_fn` are shipped once to a worker process (a
one-rank `RayWorkerGroup` on the node's first `placement` device, or on
device i for the i-th node without one), and `node(items)` becomes a call
on it; the flow's executor, sync or async, is unchanged. Items travel
through Ray, and a failing worker surfaces as a `NodeError` carrying the
worker's traceback. Simplified: one process per node (a model is not split
over several devices here; `device_map="auto"` places it within its process).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from hybridflow.controller.dispatch import Dispatch, register
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.ray_group import RayWorkerGroup
from hybridflow.controller.worker import Worker
from hybridflow.dataflow.node import Node


class NodeWorker(Worker):
    """Runs one node's forward_fn in its own process."""

    def __init__(self, name: str, model: Any, forward_fn: Callable, batch_size: Optional[int]):
        self.node = Node(name, model=model, forward_fn=forward_fn, batch_size=batch_size)

    @register(Dispatch.RANK_ZERO)
    def run(self, items: list) -> list:
        return self.node(items)


class RemoteNode(Node):
    """A node whose forward_fn runs in a Ray worker; drop-in for the executor."""

    def __init__(self, node: Node, device_index: int, device: str = "cpu"):
        super().__init__(node.name, model=None, forward_fn=node.forward_fn, placement=[device_index],
                         batch_size=node.batch_size)
        self.engine = node.engine
        self.group = RayWorkerGroup(NodeWorker, ResourcePool([device_index], device), node.name, node.model,
                                    node.forward_fn, node.batch_size)

    def __call__(self, items: list) -> list:
        return self.group.call(NodeWorker.run, items)

    def shutdown(self) -> None:
        self.group.shutdown()


def place_nodes(nodes: dict[str, Node], device: str = "cpu") -> dict[str, RemoteNode]:
    """A worker per node: its own placement's first device, else the next free index."""
    from hybridflow.controller.ray_setup import init_ray

    init_ray()
    taken = {n.placement[0] for n in nodes.values() if n.placement}
    free = (i for i in range(10**6) if i not in taken)
    placed: dict[str, RemoteNode] = {}
    try:
        for name, node in nodes.items():
            index = node.placement[0] if node.placement else next(free)
            placed[name] = RemoteNode(node, index, device)
    except BaseException:
        for remote in placed.values():
            remote.shutdown()
        raise
    return placed
