"""Which Ray node each rank of a worker group runs on, and naming a node that left mid-run.

On a cluster of several machines a rank can die because its whole node went
away (power, network, a killed raylet), not because its own code failed. Ray
reports the lost actor within a couple of seconds (its connection to the driver
closes: `ActorUnavailableError` / `ActorDiedError`), but it marks the node dead
only after its health checks miss several beats (~15 s by default). So when a
call fails, the controller asks about every node of the failing group at once:
dead in the cluster's table (`ray.nodes()`), or alive there but with a raylet
that does not accept a connection any more. A lost node is then named in the
error — its node id, its address and the ranks and roles it held — instead of
a bare "worker process died" or a gloo "connection reset" from a surviving peer.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Sequence

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0  # a raylet on a live node accepts at once; a vanished host never answers


@dataclass(frozen=True)
class NodeOf:
    """Where one rank runs: the Ray node id (hex) and the node's IP address."""

    node_id: str
    ip: str


def placement_lines(roles: str, nodes: Sequence[NodeOf]) -> list[str]:
    """One line per node: which ranks of `roles` (the worker classes sharing these processes) run there."""
    ranks: dict[NodeOf, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(rank)
    return [f"{roles}: rank(s) {held} on node {node.node_id} ({node.ip})" for node, held in ranks.items()]


def log_placement(roles: str, nodes: Sequence[NodeOf]) -> None:
    """Say where a group's ranks landed (INFO): the first thing to read when a node later goes missing."""
    for line in placement_lines(roles, nodes):
        log.info(line)


def lost_nodes(nodes: Sequence[NodeOf]) -> dict[NodeOf, str]:
    """The nodes among `nodes` that have left the cluster, each with how that was seen.

    A node counts as lost when Ray's table lists it dead, or when its raylet
    (the node manager port Ray's table gives) no longer accepts a TCP
    connection. Called only after a call has failed, so the cost (one GCS
    query, one connect per node) is paid on the error path alone.
    """
    import ray

    table = {entry["NodeID"]: entry for entry in ray.nodes()}
    lost = {}
    for node in dict.fromkeys(nodes):
        entry = table.get(node.node_id)
        if entry is None:
            lost[node] = "it is no longer in the Ray cluster's node table"
        elif not entry["Alive"]:
            lost[node] = "the Ray cluster marked it dead"
        else:
            address = (entry["NodeManagerAddress"], entry["NodeManagerPort"])
            if not _answers(address):
                lost[node] = f"its raylet at {address[0]}:{address[1]} does not answer"
    return lost


def _answers(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def describe_lost(roles: str, nodes: Sequence[NodeOf], lost: dict[NodeOf, str]) -> str:
    """'node ID (IP) left the Ray cluster (why); it held rank(s) [...] of ROLES', one clause per lost node."""
    parts = []
    for node, why in lost.items():
        held = [rank for rank, where in enumerate(nodes) if where == node]
        parts.append(f"node {node.node_id} ({node.ip}) left the Ray cluster ({why}); it held rank(s) {held} "
                     f"of {roles}")
    return "; ".join(parts)
