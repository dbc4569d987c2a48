"""`DataFlow`: nodes and edges, checked as they are added, planned into a topological order.

Rules (each broken rule is a `DataFlowError` naming the culprit):

- node names are unique; an edge names nodes already in the flow (by object
  or by name); no edge is declared twice; edges never close a cycle (the
  error spells the cycle out: ``a -> b -> a``);
- at run time the flow has exactly one source, the node without an input
  edge: it receives the run's inputs. A second source would have no inputs
  to receive, so it is an error (connect it, or remove it).

Every declared edge runs (`plan()` shows the order). A node with several
inputs receives each sample once, if every input passed it on
(`execute.py`): adding a filter between two connected nodes takes one node
and two edges (``rollout -> safety -> reward`` beside ``rollout -> reward``),
and only the samples the filter passes reach the node after it. Inputs with
items of their own (independent branches) are zipped into tuples, in the
order the edges were declared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from hybridflow.dataflow.node import Node
from hybridflow.dataflow.off_policy import RolloutStream, Schedule
from hybridflow.hybrid_engine.rollout_weights import LockStep, Streamed
from hybridflow.dataflow.plan import DataFlowError, Plan
from hybridflow.common import nearest_name

__all__ = ["DataFlow", "DataFlowError", "Plan", "StepResult"]

NodeRef = Union[Node, str]


class DataFlow:
    """A directed acyclic graph of `Node`s; `run(inputs)` pushes the inputs through it."""

    def __init__(self, nodes: Iterable[Node] = (),
                 edges: Iterable[tuple[NodeRef, NodeRef]] = ()):
        self.nodes: dict[str, Node] = {}
        self.edges: list[tuple[str, str]] = []
        self._plan: Optional[Plan] = None
        for node in nodes:
            self.add_node(node)
        for edge in edges:
            if not isinstance(edge, (tuple, list)) or len(edge) != 2:
                raise DataFlowError(f"an edge is a pair (upstream, downstream), got {edge!r}")
            self.add_edge(*edge)

    # -- building ---------------------------------------------------------
    def add_node(self, node: Node) -> Node:
        if not isinstance(node, Node):
            raise DataFlowError(f"add_node takes a Node, got {type(node).__name__}")
        if node.name in self.nodes:
            raise DataFlowError(f"duplicate node name {node.name!r}: every node in a DataFlow "
                                f"needs its own name")
        self.nodes[node.name] = node
        self._plan = None
        return node

    def _name(self, ref: NodeRef, edge: str) -> str:
        name = ref.name if isinstance(ref, Node) else ref
        if not isinstance(name, str):
            raise DataFlowError(f"edge {edge}: expected a Node or a node name, got {type(ref).__name__}")
        if name not in self.nodes:
            close = nearest_name(name, self.nodes)
            hint = f"did you mean {close!r}? " if close else ""
            raise DataFlowError(f"edge {edge}: unknown node {name!r} ({hint}nodes in the flow: "
                                f"{', '.join(map(repr, self.nodes)) or 'none'}; add it with add_node first)")
        if isinstance(ref, Node) and self.nodes[name] is not ref:
            raise DataFlowError(f"edge {edge}: a different node named {name!r} is in the flow")
        return name

    def add_edge(self, upstream: NodeRef, downstream: NodeRef) -> None:
        """Route every item `upstream` passes on to `downstream`."""
        label = f"({_label(upstream)} -> {_label(downstream)})"
        a, b = self._name(upstream, label), self._name(downstream, label)
        if (a, b) in self.edges:
            raise DataFlowError(f"edge {a} -> {b} is already in the flow")
        path = self._path(b, a)
        if path is not None:
            raise DataFlowError(f"edge {a} -> {b} would close a cycle: {' -> '.join(path + [b])}")
        self.edges.append((a, b))
        self._plan = None

    # -- graph queries ----------------------------------------------------
    def _children(self, name: str) -> list[str]:
        return [b for a, b in self.edges if a == name]

    def _parents(self, name: str) -> list[str]:
        return [a for a, b in self.edges if b == name]

    def _path(self, start: str, goal: str) -> Optional[list[str]]:
        """A path start -> ... -> goal along declared edges, or None."""
        stack, seen = [[start]], {start}
        while stack:
            path = stack.pop()
            if path[-1] == goal:
                return path
            for child in self._children(path[-1]):
                if child not in seen:
                    seen.add(child)
                    stack.append(path + [child])
        return None

    # -- planning -----------------------------------------------------------
    def plan(self) -> Plan:
        """Validate the flow and return what runs (cached until the flow changes)."""
        if self._plan is None:
            self._plan = self._build_plan()
        return self._plan

    def _build_plan(self) -> Plan:
        if not self.nodes:
            raise DataFlowError("the DataFlow has no nodes")
        inputs = {n: tuple(self._parents(n)) for n in self.nodes}
        sources = [n for n in self.nodes if not inputs[n]]
        if len(sources) != 1:
            raise DataFlowError(
                f"a DataFlow needs exactly one source (a node without an input edge; it receives "
                f"the run's inputs), found {len(sources)}: {', '.join(map(repr, sources))}; connect "
                f"the others with add_edge(upstream, node)")
        outputs = {n: tuple(b for b in self.nodes if n in inputs[b]) for n in self.nodes}
        order, indegree = [], {n: len(inputs[n]) for n in self.nodes}
        ready = [n for n in self.nodes if indegree[n] == 0]
        while ready:
            node = ready.pop(0)
            order.append(node)
            for child in outputs[node]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    ready.append(child)
        assert len(order) == len(self.nodes), "add_edge admits no cycle"
        return Plan(order=tuple(order), source=sources[0],
                    sinks=tuple(n for n in order if not outputs[n]),
                    inputs=inputs, outputs=outputs)

    # -- running -----------------------------------------------------------
    def run(self, inputs: Sequence[Any], async_execution: bool = False, min_batch: int = 0,
            launcher: str = "local"):
        """Push `inputs` (a list of items, e.g. prompts) through the flow -> `FlowResult`.

        Sync (default): each node runs once on everything its upstream passed
        on, in topological order. `async_execution=True` with `min_batch=N > 0`:
        the source runs on chunks of N inputs and every node works on each
        chunk as soon as its upstream finishes it, each node on its own
        thread; results are re-assembled in input order (identical to sync
        when forward_fn treats items independently). `min_batch=0` runs sync.
        (The trainer cuts a step's prompts into chunks of
        `dataflow.min_batch_for_reward` responses itself and passes each chunk
        as one item with `min_batch=1`.)
        `launcher="ray"` runs every node in its own Ray worker process
        (`hybridflow.dataflow.remote`) for this run; "local" runs them here.
        """
        from hybridflow.dataflow.execute import run_async, run_sync

        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
            raise TypeError(f"DataFlow.run takes a list of input items, got {type(inputs).__name__}")
        if not isinstance(min_batch, int) or min_batch < 0:
            raise ValueError(f"min_batch must be an int >= 0, got {min_batch!r}")
        if launcher not in ("local", "ray"):
            raise ValueError(f"launcher must be 'local' or 'ray', got {launcher!r}")
        plan = self.plan()
        nodes: dict[str, Node] = self.nodes
        if launcher == "ray":
            from hybridflow.dataflow.remote import place_nodes
            nodes = place_nodes(self.nodes)
        try:
            if async_execution and min_batch > 0:
                return run_async(nodes, plan, list(inputs), min_batch)
            return run_sync(nodes, plan, list(inputs))
        finally:
            if nodes is not self.nodes:
                for remote in nodes.values():
                    remote.shutdown()

    def run_steps(self, batches: Sequence[Sequence[Any]], update: Callable[[Any, int], Any], *,
                  publish: Optional[Callable[[], Any]] = None, load: Optional[Callable[[Any], None]] = None,
                  off_policy: str = "sync", max_staleness: int = 1, sync_every: int = 1,
                  stale_samples: str = "wait", async_execution: bool = False, min_batch: int = 0) -> list[StepResult]:
        """Train on the flow: step t runs the flow on `batches[t - 1]`, then `update(result, t)`.

        The modes are the trainer's (`trainer.off_policy`, `hybridflow/dataflow/off_policy.py`), driven
        through the same weight strategies as the trainer's (`hybrid_engine/rollout_weights.py`): "sync"
        runs flow and update in lock step; "one_step" runs the flow of step t + 1 on a thread of its own
        while update t runs, from the weights of before it; "async" lets the flow run up to
        `max_staleness` weight versions ahead, weights pushed every `sync_every` updates (and
        `stale_samples="drop"`: it never waits, and a result staler than that is generated again).
        Overlap needs the generating model apart from the trained one: `publish()` returns a snapshot of
        the trained weights (called between updates), `load(snapshot)` puts one into the model the flow
        generates with (called on the flow's thread, between runs). In "sync" both may be left out (the
        update changes the model the next run uses). Returns one `StepResult` per step: the flow's
        result, the weight version that generated it, its staleness, and what `update` returned.
        """
        schedule = Schedule.make(off_policy, len(batches), max_staleness, sync_every, stale_samples)
        if off_policy != "sync" and (publish is None or load is None):
            missing = " and ".join(n for n, f in (("publish", publish), ("load", load)) if f is None)
            raise ValueError(f"off_policy={off_policy!r} generates while update runs: give {missing} (the "
                             "trained weights as a snapshot, and loading one into the generating model)")
        run = lambda items, version: self.run(items, async_execution, min_batch)  # noqa: E731
        inputs = lambda step: batches[step - 1]  # noqa: E731
        if off_policy == "sync":
            refresh = (lambda: load(publish())) if publish is not None and load is not None else None
            weights = LockStep(inputs, run, refresh=refresh)
        else:
            weights = Streamed(RolloutStream(schedule, run, load, publish, inputs))
        out = []
        try:
            for step in range(1, len(batches) + 1):
                got = weights.take(step, step - 1)
                out.append(StepResult(step, got.version, step - 1 - got.version, got.output,
                                      update(got.output, step), got.dropped))
                weights.updated(step)
        finally:
            weights.close()
        return out

    def __repr__(self) -> str:
        edges = ", ".join(f"{a}->{b}" for a, b in self.edges)
        return f"DataFlow(nodes=[{', '.join(self.nodes)}], edges=[{edges}])"


@dataclass
class StepResult:
    """One step of `DataFlow.run_steps`."""

    step: int
    version: int  # the weight version (updates taken) that generated the flow's result
    staleness: int  # updates between those weights and the ones `update` started from
    flow: Any  # the FlowResult of the step's inputs
    update: Any  # what update(flow, step) returned
    dropped: int = 0  # results of this step dropped as too stale (stale_samples="drop")


def _label(ref: Any) -> str:
    return ref.name if isinstance(ref, Node) else str(ref)
