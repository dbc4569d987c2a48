"""How one call on a worker group is spread over its ranks and how the results come back.

A worker method is tagged with its mode once, `@register(Dispatch.DP_SPLIT)`;
`group.method(...)` then dispatches by that mode, so controller code reads
`out = actor.compute_log_probs(batch)` and holds no communication code.
The modes, all defined in `_MODES` below:

| mode         | caller passes                       | rank r receives                     | caller gets                  |
|--------------|-------------------------------------|-------------------------------------|------------------------------|
| `ONE_TO_ALL` | args                                | the same args                       | list of results, rank order  |
| `RANK_ZERO`  | args                                | the same args                       | rank 0's result              |
| `DP_SPLIT`   | a batch first, then other args      | row chunk r of the batch; the rest  | results concatenated, rank   |
|              |                                     | unchanged                           | order                        |
| `ALL_TO_ALL` | every arg a list of world values    | element r of each                   | list of results, rank order  |

`RANK_ZERO` still runs every rank, since SPMD methods meet in collectives;
only rank 0's answer is returned (e.g. metrics already all-reduced).

**Meshes.** With tensor or pipeline parallelism, several ranks together hold
one model replica and must see the *same* rows. A `DP_SPLIT` method
registered with `mesh="actor"` is split over the data-parallel replicas of
that mesh, not over ranks: a worker registers its coordinates in each mesh it
serves (`Worker.register_mesh(name, dims)`, one `MeshCoord` per rank); chunk
d of the batch goes to every rank of replica d, and the caller gets one
answer per replica, from the rank that `answers` for it (last pipeline stage,
TP rank 0), concatenated in replica order. A method with no mesh treats every
rank as its own replica.

A *batch* is a dict whose values are tensors (rows along dim 0) or
lists/tuples (one item per row) — the shape of the RL batches in
`hybridflow.data.fields` — or a bare tensor or list (row operations:
`hybridflow.data.batch`). `DP_SPLIT` cuts it into one equal chunk per
replica and concatenates what the ranks return, field by field: tensors with
`torch.cat`, lists and tuples joined, anything else (floats, strings, 0-d
tensors) gathered into one list entry per rank. A batch whose rows do not
divide is padded (its last row repeated) and the padding is stripped from
per-row answers (`call_batch`, `strip_padding`); per-rank values in an
answer come back `Gathered` and are never stripped (a per-rank 1-d tensor
would read as rows: answers keep tensors per-row). Chunks are views of the
caller's batch (a padded batch is a copy); `RayWorkerGroup` sends each as a
numpy view of its own rows (no copy on the driver; see `_Array` in
transfer.py).

**Fields.** A method registered with `reads=(...)` receives only those
fields of its batch: the controller ships 4 tensors to a log-prob pass, not
the 10 of a full training batch.

**Per-replica arguments.** A `PerReplica([...])` argument to a `DP_SPLIT`
method holds one value per replica, and replica d receives element d as it
is (no splitting). The trainer uses it for updates, whose replicas receive
different rows (`data.batch.mini_batch_plan`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from hybridflow.data.batch import (Gathered, RowsElsewhere, concat, pad_rows, row_count, select_fields, split_rows,
                                   unpad)

_ATTR = "__hybridflow_dispatch__"
_MESH_ATTR = "__hybridflow_mesh__"
_READS_ATTR = "__hybridflow_reads__"
_ASIDE_ATTR = "__hybridflow_aside__"

PerRank = list[tuple[tuple, dict]]  # (args, kwargs) for each rank, rank order


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    RANK_ZERO = "rank_zero"
    DP_SPLIT = "dp_split"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class MeshCoord:
    """Where one rank sits in a data-parallel mesh: the replica it serves, and whether it answers for it."""

    dp_rank: int
    dp_size: int
    answers: bool


def flat_mesh(world: int) -> list[MeshCoord]:
    """Every rank its own replica (no model parallelism)."""
    return [MeshCoord(rank, world, True) for rank in range(world)]


def check_mesh(name: str, coords: Sequence[MeshCoord]) -> None:
    """Each replica has at least one rank and exactly one that answers."""
    sizes = {c.dp_size for c in coords}
    if len(sizes) != 1:
        raise ValueError(f"mesh {name!r}: ranks disagree on the number of replicas: {sorted(sizes)}")
    size = sizes.pop()
    answering = sorted(c.dp_rank for c in coords if c.answers)
    if answering != list(range(size)) or any(not 0 <= c.dp_rank < size for c in coords):
        raise ValueError(f"mesh {name!r}: each of the {size} replicas needs exactly one answering rank; "
                         f"got {list(coords)}")


def register(mode: Dispatch | str, mesh: Optional[str] = None, reads: Optional[Sequence[str]] = None,
             aside: bool = False) -> Callable:
    """Tag a worker method with its dispatch mode; the group runs tagged methods only.

    mesh: for DP_SPLIT, the name of the data-parallel mesh the batch is split
        over (see the module docstring); None splits over every rank.
    reads: for DP_SPLIT, the batch fields the method may read; only those
        the batch holds are shipped (None: every field it is given).
    aside: a Ray group runs the method on a second thread of the worker's
        process, beside its other calls instead of after the one in progress
        (one aside call at a time, in order). Only for a method that reads
        and writes nothing the ordinary calls touch without a lock (a staged
        weight copy's broadcast while the actor trains: `rl_workers.py`).
    """
    mode = _as_mode(mode)
    for what, value in (("a mesh", mesh), ("reads", reads)):
        if value is not None and mode is not Dispatch.DP_SPLIT:
            raise ValueError(f"{what} only applies to DP_SPLIT methods, not {mode.name}")

    def tag(fn: Callable) -> Callable:
        setattr(fn, _ATTR, mode)
        setattr(fn, _MESH_ATTR, mesh)
        setattr(fn, _READS_ATTR, None if reads is None else tuple(reads))
        setattr(fn, _ASIDE_ATTR, aside)
        return fn

    return tag


def method_mesh(fn: Callable) -> Optional[str]:
    """The mesh a registered method's DP_SPLIT runs over (None: every rank)."""
    return getattr(fn, _MESH_ATTR, None)


def method_aside(fn: Callable) -> bool:
    """Whether a registered method runs beside the worker's other calls (`register(aside=True)`)."""
    return getattr(fn, _ASIDE_ATTR, False)


def method_reads(fn: Callable) -> Optional[tuple[str, ...]]:
    """The batch fields a registered DP_SPLIT method reads (None: all it is given)."""
    return getattr(fn, _READS_ATTR, None)


class PerReplica(list):
    """One value per data-parallel replica, for a DP_SPLIT argument: replica d receives element d."""


def call_batch(fn: Callable, args: tuple, replicas: int) -> tuple[tuple, Optional[Tensor]]:
    """A DP_SPLIT call's arguments as shipped: its batch cut down to the fields `fn` reads and padded to
    a multiple of `replicas`, and the mask of real rows (None when nothing was padded or the batch is
    given per replica)."""
    if not args:
        return args, None
    reads = method_reads(fn)

    def needed(batch: Any) -> Any:
        return select_fields(batch, reads) if reads is not None and isinstance(batch, dict) else batch

    if isinstance(args[0], PerReplica):
        return (PerReplica(needed(b) for b in args[0]), *args[1:]), None
    try:
        batch, real = pad_rows(needed(args[0]), replicas)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"DP_SPLIT method {fn.__qualname__} (reads {reads or 'every field'}) needs a batch "
                        f"(dict of tensors/lists, tensor or list) first: {exc}") from None
    return (batch, *args[1:]), None if bool(real.all()) else real


def strip_padding(answer: Any, real: Optional[Tensor]) -> Any:
    """A DP_SPLIT answer without the rows `call_batch` padded. Per-row fields with k rows per batch row
    (a rollout's n samples of each prompt, prompt-major) lose the padded rows' k; other values stay."""
    if real is None or isinstance(answer, Gathered):  # one value per rank, not rows
        return answer
    if isinstance(answer, dict):
        out, by_rows = {}, {}
        for key, value in answer.items():
            rows = -1 if isinstance(value, (dict, Gathered)) else _rows_of(value)
            if rows > 0 and rows % len(real) == 0:
                by_rows.setdefault(rows, {})[key] = value
            else:
                out[key] = strip_padding(value, real)
        for rows, fields in by_rows.items():  # one take per row count: fields kept elsewhere keep one index
            out.update(unpad(fields, real.repeat_interleave(rows // len(real))))
        return {key: out[key] for key in answer}
    rows = _rows_of(answer)
    if rows <= 0 or rows % len(real):
        return answer
    return unpad(answer, real.repeat_interleave(rows // len(real)))


def shipped_bytes(per_rank: PerRank) -> int:
    """The tensor bytes a call's arguments deliver, summed over the ranks (what each rank receives)."""
    return sum(tensor_bytes(rank) for rank in per_rank)


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor inside `value` (dicts, lists, tuples): what a call's answer brings back.
    A field kept elsewhere (`data.batch.RowsElsewhere`) counts its row index, once for the fields sharing it."""
    total, indexes = 0, {}
    for leaf in tree_leaves(value):
        if isinstance(leaf, Tensor):
            total += leaf.nbytes
        elif isinstance(leaf, RowsElsewhere):
            indexes[id(leaf.rows)] = leaf.rows.nbytes
    return total + sum(indexes.values())


def _rows_of(value: Any) -> int:
    try:
        return row_count(value)
    except (TypeError, ValueError):
        return -1


def registered_methods(cls: type) -> dict[str, Dispatch]:
    """Name -> mode of every `@register`-ed method of `cls`, base classes included."""
    found: dict[str, Dispatch] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            mode = getattr(fn, _ATTR, None) if callable(fn) else None
            if mode is not None:
                found[name] = mode
            elif name in found:  # overridden without the tag: no longer exposed
                del found[name]
    return found


def _as_mode(mode: Dispatch | str) -> Dispatch:
    if isinstance(mode, Dispatch):
        return mode
    try:
        return Dispatch[str(mode).upper()]
    except KeyError:
        raise ValueError(f"unknown dispatch mode {mode!r}; modes: {[m.name for m in Dispatch]}") from None


# --------------------------------------------------------------------------- batches

def batch_size(batch: Any) -> int:
    """Rows in a batch (`data.batch.row_count`), named for DP_SPLIT's errors."""
    try:
        return row_count(batch)
    except TypeError as exc:
        raise TypeError(f"DP_SPLIT needs a batch (dict of tensors/lists, tensor or list) first: {exc}") from None


def split_batch(batch: Any, n: int) -> list[Any]:
    """`n` equal row chunks in order (views of the batch's tensors)."""
    try:
        return split_rows(batch, n)
    except TypeError as exc:
        raise TypeError(f"DP_SPLIT needs a batch (dict of tensors/lists, tensor or list) first: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"DP_SPLIT: {exc}") from None


def concat_batches(parts: Sequence[Any]) -> Any:
    """Inverse of `split_batch` on what the ranks return (see the module docstring)."""
    try:
        return concat(parts, "rank")
    except ValueError as exc:
        raise ValueError(f"DP_SPLIT: {exc}") from None


# --------------------------------------------------------------------------- modes

def _same_for_all(world: int, args: tuple, kwargs: dict, mesh: Sequence[MeshCoord]) -> PerRank:
    return [(args, kwargs)] * world


def _dp_split(world: int, args: tuple, kwargs: dict, mesh: Sequence[MeshCoord]) -> PerRank:
    if not args:
        raise TypeError("DP_SPLIT methods take the batch as their first positional argument")
    replicas = mesh[0].dp_size
    for what, value in [("the batch", args[0]), *((f"argument {i}", a) for i, a in enumerate(args[1:], 1)),
                        *((f"argument {k!r}", v) for k, v in kwargs.items())]:
        if isinstance(value, PerReplica) and len(value) != replicas:
            raise ValueError(f"DP_SPLIT: {what} holds {len(value)} values for {replicas} replicas")
    chunks = args[0] if isinstance(args[0], PerReplica) else split_batch(args[0], replicas)

    def mine(value: Any, d: int) -> Any:
        return value[d] if isinstance(value, PerReplica) else value

    return [((chunks[c.dp_rank], *(mine(a, c.dp_rank) for a in args[1:])),
             {k: mine(v, c.dp_rank) for k, v in kwargs.items()}) for c in mesh]


def answering(results: list, mesh: Sequence[MeshCoord]) -> list:
    """The results of the ranks that answer for their replica, in replica order."""
    return [results[rank] for rank, _ in sorted(((r, c) for r, c in enumerate(mesh) if c.answers),
                                                key=lambda rc: rc[1].dp_rank)]


def _all_to_all(world: int, args: tuple, kwargs: dict, mesh: Sequence[MeshCoord]) -> PerRank:
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for what, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != world:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"ALL_TO_ALL: {what} must be a list with one value per rank ({world}), got {got}")
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world)]


@dataclass(frozen=True)
class _Rule:
    split: Callable[[int, tuple, dict, Sequence[MeshCoord]], PerRank]
    collect: Callable[[list, Sequence[MeshCoord]], Any]


_MODES: dict[Dispatch, _Rule] = {
    Dispatch.ONE_TO_ALL: _Rule(_same_for_all, lambda results, mesh: results),
    Dispatch.RANK_ZERO: _Rule(_same_for_all, lambda results, mesh: results[0]),
    Dispatch.DP_SPLIT: _Rule(_dp_split, lambda results, mesh: concat_batches(answering(results, mesh))),
    Dispatch.ALL_TO_ALL: _Rule(_all_to_all, lambda results, mesh: results),
}


def dispatch(mode: Dispatch, world: int, args: tuple, kwargs: dict,
             mesh: Optional[Sequence[MeshCoord]] = None) -> PerRank:
    """(args, kwargs) for each of `world` ranks; DP_SPLIT follows `mesh` (default: every rank a replica)."""
    return _MODES[mode].split(world, tuple(args), dict(kwargs), mesh or flat_mesh(world))


def collect(mode: Dispatch, results: list, mesh: Optional[Sequence[MeshCoord]] = None) -> Any:
    """What the caller gets from the ranks' results (rank order); DP_SPLIT keeps the answering ranks'."""
    return _MODES[mode].collect(list(results), mesh or flat_mesh(len(results)))
