"""Running a reward function so that it can neither stall nor kill a run.

`GuardedReward(fn, name, timeout_s, workers)` scores rows (the verl signature's
four arguments) and returns one `Outcome` per row: the score, or why the row
scored 0 ("error": it raised, "value": it returned something that is not one
finite number, "timeout": it ran past `timeout_s`, "crash": its process died).
Deciding whether too many rows failed is the caller's (`roles.scoring`).

With `workers=0` the calls run one at a time on a helper thread of this
process; a call past its time limit is abandoned there (Python cannot stop a
thread), so only rewards that bound their own work belong there. With
`workers=N` the calls run in N forked processes: a call past its time limit,
or one that crashes its process, is killed and the process replaced, so a
hanging sympy comparison or a segfault costs one row, never the step. The
processes are forked (not spawned) so a function registered only in this
process, or a closure, scores there as it would here.
"""
from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
import numbers
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Optional, Sequence

__all__ = ["Outcome", "GuardedReward", "RewardValueError", "reward_value", "failure_text", "where"]

Row = tuple  # (data_source, solution_str, ground_truth, extra_info)


class RewardValueError(TypeError):
    """A reward function returned something that is not a finite number; the message names the function."""


@dataclass(frozen=True)
class Outcome:
    """One row's score, or (score 0) what went wrong: kind in "error", "value", "timeout", "crash"."""

    score: float = 0.0
    kind: Optional[str] = None
    text: str = ""

    @property
    def failed(self) -> bool:
        return self.kind is not None


def where(fn: Callable) -> str:
    """`file:line` of a function's definition, or its repr when it has no source (a builtin, a partial)."""
    import inspect

    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return repr(fn)


def reward_value(value: Any, fn: Callable) -> float:
    """`value` as a float if it is one finite real number (a bool, int, float, or a 0-d numpy/torch number),
    or a dict holding one under "score" (as verl's custom rewards may return; the other keys are not used);
    RewardValueError naming what came back otherwise."""
    from hybridflow.common import shown_value

    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if hasattr(value, "numel") and value.numel() == 1 and not value.is_complex():  # a torch tensor
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "size", None) == 1:  # a numpy scalar or 1-element array
        value = value.item()
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    what = "not a finite number" if isinstance(value, numbers.Real) else f"a {type(value).__name__}, not a number"
    raise RewardValueError(f"returned {shown_value(value)} ({what}): a reward function returns one float per "
                           f"response, defined at {where(fn)}")


def failure_text(exc: BaseException, name: str) -> str:
    """One line: "reward.function NAME raised Type: message (at file:line)", the line being the deepest one in
    the file of the first frame outside this module (the reward function's own file: it is user code)."""
    if isinstance(exc, RewardValueError):
        return f"reward.function {name!r} {exc}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    at = ""
    if frames:
        frame = [f for f in frames if f.filename == frames[0].filename][-1]
        at = f" (at {frame.filename}:{frame.lineno})"
    return f"reward.function {name!r} raised {type(exc).__name__}: {exc}{at}"


def _call(fn: Callable, row: Row, name: str) -> Outcome:
    try:
        return Outcome(reward_value(fn(*row), fn))
    except RewardValueError as exc:
        return Outcome(0.0, "value", failure_text(exc, name))
    except Exception as exc:
        return Outcome(0.0, "error", failure_text(exc, name))


class _ThreadRunner:
    """Calls on one helper thread, replaced when a call overruns (the overrunning one is left behind)."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name
        self._start()

    def _start(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        inbox, outbox = self.inbox, self.outbox  # the thread keeps its own pair if it is abandoned

        def serve() -> None:
            while (row := inbox.get()) is not None:
                outbox.put(_call(self.fn, row, self.name))

        threading.Thread(target=serve, name=f"reward-{self.name}", daemon=True).start()

    def run(self, rows: Sequence[Row], timeout_s: float) -> list[Outcome]:
        outcomes = []
        for row in rows:
            self.inbox.put(row)
            try:
                outcomes.append(self.outbox.get(timeout=timeout_s))
            except queue.Empty:
                outcomes.append(_timed_out(self.name, timeout_s))
                self._start()
        return outcomes

    def close(self) -> None:
        self.inbox.put(None)


def _timed_out(name: str, timeout_s: float) -> Outcome:
    return Outcome(0.0, "timeout", f"reward.function {name!r} did not return within reward.timeout_s={timeout_s:g} s")


def _serve(fn: Callable, name: str, conn) -> None:
    """A pool process: score the rows sent until the pipe closes; dies with its parent."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the scoring process
    except (OSError, AttributeError):
        pass
    while True:
        try:
            i, row = conn.recv()
        except (EOFError, OSError):
            return
        conn.send((i, _call(fn, row, name)))


class _Worker:
    def __init__(self, ctx, fn: Callable, name: str):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(fn, name, child), name=f"reward-{name}", daemon=True)
        self.process.start()
        child.close()
        self.row: Optional[int] = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(5)
        self.conn.close()


class _ProcessRunner:
    """`workers` forked processes; each takes the next row when it is free."""

    def __init__(self, fn: Callable, name: str, workers: int):
        self.fn, self.name = fn, name
        self.ctx = mp.get_context("fork")
        self.workers = [_Worker(self.ctx, fn, name) for _ in range(workers)]

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker(self.ctx, self.fn, self.name)

    def run(self, rows: Sequence[Row], timeout_s: float) -> list[Outcome]:
        outcomes: list[Optional[Outcome]] = [None] * len(rows)
        todo = deque(range(len(rows)))
        while todo or any(w.row is not None for w in self.workers):
            for worker in list(self.workers):
                if worker.row is None and todo:
                    self._send(worker, todo, rows, timeout_s)
            busy = [w for w in self.workers if w.row is not None]
            left = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = set(wait([w.conn for w in busy], timeout=left))
            for worker in busy:
                if worker.conn in ready:
                    self._collect(worker, outcomes)
                elif time.monotonic() >= worker.deadline:
                    outcomes[worker.row] = _timed_out(self.name, timeout_s)
                    self._replace(worker)
        return outcomes  # type: ignore[return-value]

    def _send(self, worker: _Worker, todo: deque, rows: Sequence[Row], timeout_s: float) -> None:
        """Hand `worker` the next row; one that died while idle (the OOM killer) is replaced and the row resent."""
        row = todo.popleft()
        try:
            worker.conn.send((row, rows[row]))
        except OSError:  # BrokenPipeError: the process is gone
            index = self.workers.index(worker)
            self._replace(worker)
            worker = self.workers[index]
            worker.conn.send((row, rows[row]))
        worker.row, worker.deadline = row, time.monotonic() + timeout_s

    def _collect(self, worker: _Worker, outcomes: list) -> None:
        row = worker.row
        try:
            i, outcome = worker.conn.recv()
        except (EOFError, OSError):  # the process died mid-call (a segfault, the OOM killer, os._exit)
            worker.process.join(1)
            code = worker.process.exitcode
            outcome = Outcome(0.0, "crash", f"reward.function {self.name!r} killed its scoring process "
                                            f"(exit code {code})")
            self._replace(worker)
        else:
            worker.row = None
        outcomes[row] = outcome

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()


class GuardedReward:
    """`fn(data_source, solution_str, ground_truth, extra_info)` scored with a per-call time limit; `name` is
    how errors name it (reward.function). `workers`: 0 scores on a thread of this process, N > 0 in N forked
    processes (see the module's docstring)."""

    def __init__(self, fn: Callable, name: str, timeout_s: float = 30.0, workers: int = 0):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        self.fn, self.name, self.timeout_s, self.workers = fn, name, float(timeout_s), workers
        self._runner: Any = None

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: Optional[dict] = None) -> float:
        """The plain reward function, unguarded (the verl signature, for callers that score one row)."""
        return reward_value(self.fn(data_source, solution_str, ground_truth, extra_info), self.fn)

    def start(self) -> None:
        """Start the thread or the processes now (else on first use): a caller about to score from a thread
        of its own starts them first, so the pool is forked by the thread that made it."""
        if self._runner is None:  # a process pool forks the process that scores
            self._runner = (_ProcessRunner(self.fn, self.name, self.workers) if self.workers
                            else _ThreadRunner(self.fn, self.name))

    def score_rows(self, rows: Sequence[Row]) -> list[Outcome]:
        if not rows:
            return []
        self.start()
        return self._runner.run(list(rows), self.timeout_s)

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
