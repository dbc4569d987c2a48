"""Running a planned DataFlow in-process: sync (node by node) or async (chunks streamed).

Both modes share one step, `_run_node`: call the node's forward_fn, then read
its outputs. A node with downstream edges that returns one `bool` per item is
a filter: items marked True are passed on (the item, not the bool), items
marked False go to `FlowResult.rejected` with the node's name, and the
report's line for it reads "Passed k of n samples". A node without
downstream edges returns results, bools included. Any other list is passed
on as is. A node that receives no items is not called.

Items travel with the sample (row) they belong to, so that a node with
several inputs receives each sample once, from every edge declared into it:
the samples all its inputs passed on, in order. Inputs that carry the same
items (a filter passes its input's on) are given once; inputs with items of
their own are zipped into tuples, in the order the edges were declared. So
`rollout -> safety -> reward` beside `rollout -> reward` scores the samples
safety passed, and `rollout -> critic -> reward` beside `rollout -> reward`
gives reward (response, value) pairs. A node that returns a different number
of items than it receives (n samples per prompt) starts new samples; joining
those with the samples of another branch is an error.

Async: each node gets a thread and an inbox. The source works through its
inputs `min_batch` at a time and sends each finished chunk downstream at
once, so downstream nodes run on chunk 0 while the source works on chunk 1.
Results are kept per chunk index and concatenated in index order, which
makes them identical to a sync run whenever forward_fn treats items
independently (greedy generation, per-item scores). The first error stops
the source and is raised from `run`.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from hybridflow.dataflow.plan import DataFlowError, Plan
from hybridflow.dataflow.node import Node, NodeError

__all__ = ["FlowResult", "NodeStats", "run_async", "run_sync"]

SOURCE, FILTER, MAP = "source", "filter", "map"
INPUTS = ""  # the lineage and origin of the run's inputs (what the source receives)


@dataclass
class NodeStats:
    """One node's work in a run: items received, items passed on, time inside forward_fn."""
    role: str              # "source", "filter" or "map"
    items_in: int = 0
    items_out: int = 0     # outputs (map, source) or passed items (filter)
    seconds: float = 0.0
    numeric: bool = True   # every output a number or a bool (report says "Scored")


@dataclass
class FlowResult:
    outputs: dict[str, list]                    # node -> forward_fn outputs (a filter's: its bools)
    timings: dict[str, float]                   # node -> seconds inside forward_fn
    rejected: list[tuple[str, Any]]             # (filter node, its input item), in input order
    final: Any                                  # what the sink passes on; {sink: items} if several
    stats: dict[str, NodeStats]
    order: tuple[str, ...]
    wall_s: float = 0.0
    overlap_s: float = 0.0  # seconds downstream nodes worked while the source still ran

    @property
    def filtered(self) -> tuple[str, ...]:
        """The nodes that acted as filters in this run, in flow order."""
        return tuple(name for name in self.order if self.stats[name].role == FILTER)

    def report(self) -> str:
        """One line per node, in flow order, e.g. ``[Reward] Scored 2 samples in 0.6s``; a filter's line
        says how many samples it passed: ``[Safety] Passed 1 of 2 samples in 0.3s``."""
        return "\n".join(_report_line(name, self.stats[name]) for name in self.order)


def _report_line(name: str, s: NodeStats) -> str:
    title = f"[{name[:1].upper()}{name[1:]}]"
    if s.role == FILTER:
        what = f"Passed {s.items_out} of {_count(s.items_in, 'sample')}"
    elif s.role == SOURCE:
        what = f"Generated {_count(s.items_out, 'response')}"
    else:
        what = f"{'Scored' if s.numeric else 'Processed'} {_count(s.items_in, 'sample')}"
    return f"{title} {what} in {s.seconds:.1f}s"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass
class _Sent:
    """Items on their way to a node, each with its sample: `rows[i]` numbers item i's sample among those
    of `lineage` (the run's inputs, or the last node that changed the number of items). `origin` names
    whose outputs the items are: a filter passes its input's on, so they keep their origin."""
    items: list
    rows: list[int]
    lineage: str
    origin: Hashable


@dataclass
class _Step:
    """One call of a node on one chunk."""
    received: _Sent
    outputs: list
    sent: _Sent                        # what goes downstream
    rejected: list
    is_filter: Optional[bool]          # None: not called (no items)
    start: float = 0.0
    end: float = 0.0


def _run_node(node: Node, got: _Sent, has_downstream: bool) -> _Step:
    items = got.items
    if not items:
        return _Step(got, [], got, [], None)
    start = time.perf_counter()
    try:
        outputs = node(items)
    except NodeError:
        raise
    except Exception as exc:
        raise NodeError(f"node {node.name!r}: forward_fn raised {type(exc).__name__}: {exc}") from exc
    end = time.perf_counter()
    if has_downstream and outputs and all(isinstance(o, bool) for o in outputs):
        if len(outputs) != len(items):
            raise NodeError(f"node {node.name!r} returned {len(outputs)} bools for {len(items)} items: a node "
                            f"with downstream edges that returns bools is a filter, one bool per item")
        keep = [i for i, ok in enumerate(outputs) if ok]
        sent = _Sent([items[i] for i in keep], [got.rows[i] for i in keep], got.lineage, got.origin)
        rejected = [(node.name, item) for item, ok in zip(items, outputs) if not ok]
        return _Step(got, outputs, sent, rejected, True, start, end)
    if len(outputs) == len(items):  # one output per item: the same samples
        sent = _Sent(outputs, got.rows, got.lineage, node.name)
    else:
        sent = _Sent(outputs, list(range(len(outputs))), node.name, node.name)
    return _Step(got, outputs, sent, [], False, start, end)


def _gather(name: str, plan: Plan, sent: dict[str, _Sent]) -> _Sent:
    """A node's input: its one upstream's items, or its upstreams' joined sample by sample (module docstring)."""
    ups = plan.inputs[name]
    parts = [sent[u] for u in ups]
    if len(parts) == 1:
        return parts[0]
    if not all(p.items for p in parts):  # some branch passed nothing on: no sample reached every edge
        return _Sent([], [], parts[0].lineage, None)
    if len({p.lineage for p in parts}) > 1:
        where = ", ".join(f"{u!r} passes on samples of {'the run' if p.lineage == INPUTS else repr(p.lineage)}"
                          for u, p in zip(ups, parts))
        raise DataFlowError(f"node {name!r} joins its inputs sample by sample, but {where}: a node that returns a "
                            f"different number of items than it receives (n per prompt) starts new samples")
    common = set(parts[0].rows).intersection(*(p.rows for p in parts[1:]))
    rows = [r for r in parts[0].rows if r in common]
    columns: dict[Hashable, dict[int, Any]] = {}
    for p in parts:
        columns.setdefault(p.origin, dict(zip(p.rows, p.items)))
    if len(columns) == 1:
        (origin, column), = columns.items()
        return _Sent([column[r] for r in rows], rows, parts[0].lineage, origin)
    return _Sent([tuple(column[r] for column in columns.values()) for r in rows], rows, parts[0].lineage,
                 tuple(columns))


def _assemble(plan: Plan, steps: dict[str, list[_Step]], t0: float, t1: float) -> FlowResult:
    """Combine per-chunk steps (already in chunk order) into a FlowResult."""
    outputs, timings, stats, rejected, passed_on = {}, {}, {}, [], {}
    for name in plan.order:
        node_steps = steps[name]
        kinds = {s.is_filter for s in node_steps} - {None}
        if len(kinds) > 1:
            raise NodeError(f"node {name!r} returned bools for some chunks and other values for "
                            f"others: a node is either a filter or not")
        role = FILTER if kinds == {True} else SOURCE if name == plan.source else MAP
        outputs[name] = [o for s in node_steps for o in s.outputs]
        passed_on[name] = [p for s in node_steps for p in s.sent.items]
        timings[name] = sum(s.end - s.start for s in node_steps)
        numeric = all(isinstance(o, (int, float)) for o in outputs[name])  # bools are results here
        stats[name] = NodeStats(role, sum(len(s.received.items) for s in node_steps),
                                len(passed_on[name]), timings[name], numeric)
    for name in plan.order:  # rejected items in input order within each filter
        rejected.extend(r for s in steps[name] for r in s.rejected)
    final = (passed_on[plan.sinks[0]] if len(plan.sinks) == 1
             else {sink: passed_on[sink] for sink in plan.sinks})
    return FlowResult(outputs, timings, rejected, final, stats, plan.order, wall_s=t1 - t0,
                      overlap_s=_overlap(plan, steps, t0))


def _overlap(plan: Plan, steps: dict[str, list[_Step]], t0: float) -> float:
    """Length of the union of downstream calls within [t0, the source's last call end]."""
    source_end = max((s.end for s in steps[plan.source] if s.is_filter is not None), default=t0)
    spans = sorted((s.start, min(s.end, source_end)) for name in plan.order if name != plan.source
                   for s in steps[name] if s.is_filter is not None and s.start < source_end)
    total, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            total += (cur_end - cur_start) if cur_end is not None else 0.0
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + ((cur_end - cur_start) if cur_end is not None else 0.0)


def _inputs(items: list) -> _Sent:
    return _Sent(items, list(range(len(items))), INPUTS, INPUTS)


def run_sync(nodes: dict[str, Node], plan: Plan, inputs: list) -> FlowResult:
    """Every node once, in topological order, on all the items it receives."""
    t0 = time.perf_counter()
    sent: dict[str, _Sent] = {}
    steps: dict[str, list[_Step]] = {}
    for name in plan.order:
        got = _inputs(inputs) if name == plan.source else _gather(name, plan, sent)
        step = _run_node(nodes[name], got, bool(plan.outputs[name]))
        sent[name] = step.sent
        steps[name] = [step]
    return _assemble(plan, steps, t0, time.perf_counter())


_DONE = object()


class _AsyncRun:
    """Threads and inboxes of one async run; see the module docstring."""

    def __init__(self, nodes: dict[str, Node], plan: Plan, inputs: list, min_batch: int):
        self.nodes, self.plan = nodes, plan
        self.chunks = [inputs[i:i + min_batch] for i in range(0, len(inputs), min_batch)]
        self.inbox = {name: queue.Queue() for name in plan.order}
        self.steps: dict[str, dict[int, _Step]] = {name: {} for name in plan.order}
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def _send(self, name: str, message: Any) -> None:
        for child in self.plan.outputs[name]:
            self.inbox[child].put((name, message))

    def _run(self, name: str, index: int, got: _Sent) -> None:
        """Node `name` on chunk `index`: record the step and pass what it lets through downstream."""
        step = _run_node(self.nodes[name], got, bool(self.plan.outputs[name]))
        self.steps[name][index] = step
        self._send(name, (index, step.sent))

    def _source(self) -> None:
        name = self.plan.source
        try:
            for index, chunk in enumerate(self.chunks):
                if self.stop.is_set():
                    break
                self._run(name, index, _inputs(chunk))
        except BaseException as exc:  # noqa: BLE001 - re-raised by run()
            self.errors.append(exc)
            self.stop.set()
        finally:
            self._send(name, _DONE)

    def _downstream(self, name: str) -> None:
        ups = self.plan.inputs[name]
        pending: dict[int, dict[str, _Sent]] = {}
        done = 0
        try:
            while done < len(ups):
                upstream, message = self.inbox[name].get()
                if message is _DONE:
                    done += 1
                    continue
                if self.stop.is_set():
                    continue  # drain until every upstream is done
                index, got = message
                pending.setdefault(index, {})[upstream] = got
                if len(pending[index]) == len(ups):
                    self._run(name, index, _gather(name, self.plan, pending.pop(index)))
        except BaseException as exc:  # noqa: BLE001 - re-raised by run()
            self.errors.append(exc)
            self.stop.set()
            while done < len(ups):  # let upstream threads finish sending
                if self.inbox[name].get()[1] is _DONE:
                    done += 1
        finally:
            self._send(name, _DONE)

    def run(self) -> FlowResult:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._source, name=f"dataflow-{self.plan.source}", daemon=True)]
        threads += [threading.Thread(target=self._downstream, args=(name,), name=f"dataflow-{name}",
                                     daemon=True) for name in self.plan.order if name != self.plan.source]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        t1 = time.perf_counter()
        steps = {name: [by_index[i] for i in sorted(by_index)] for name, by_index in self.steps.items()}
        return _assemble(self.plan, steps, t0, t1)


def run_async(nodes: dict[str, Node], plan: Plan, inputs: list, min_batch: int) -> FlowResult:
    """Stream chunks of `min_batch` source inputs through the flow, one thread per node."""
    if not inputs:
        return run_sync(nodes, plan, inputs)
    return _AsyncRun(nodes, plan, inputs, min_batch).run()
