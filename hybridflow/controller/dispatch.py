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
`hybridflow.data.fields` — or a bare tensor or list. `DP_SPLIT` cuts it into
`world` equal chunks (the row count must divide; pad upstream otherwise) and
concatenates what the ranks return, field by field: tensors with
`torch.cat`, lists and tuples joined, anything else (floats, strings, 0-d
tensors) gathered into one list entry per rank. Chunks are views of the
caller's batch; `RayWorkerGroup` sends each as a numpy view of its own rows
(no copy on the driver; see `_Array` in transfer.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

_ATTR = "__hybridflow_dispatch__"
_MESH_ATTR = "__hybridflow_mesh__"

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


def register(mode: Dispatch | str, mesh: Optional[str] = None) -> Callable:
    """Tag a worker method with its dispatch mode; the group runs tagged methods only.

    mesh: for DP_SPLIT, the name of the data-parallel mesh the batch is split
        over (see the module docstring); None splits over every rank.
    """
    mode = _as_mode(mode)
    if mesh is not None and mode is not Dispatch.DP_SPLIT:
        raise ValueError(f"a mesh only applies to DP_SPLIT methods, not {mode.name}")

    def tag(fn: Callable) -> Callable:
        setattr(fn, _ATTR, mode)
        setattr(fn, _MESH_ATTR, mesh)
        return fn

    return tag


def method_mesh(fn: Callable) -> Optional[str]:
    """The mesh a registered method's DP_SPLIT runs over (None: every rank)."""
    return getattr(fn, _MESH_ATTR, None)


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
    """Rows in a batch; every field of a dict batch must have the same count."""
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            raise ValueError("a 0-d tensor has no rows to split")
        return batch.shape[0]
    if isinstance(batch, (list, tuple)):
        return len(batch)
    if isinstance(batch, dict):
        if not batch:
            raise ValueError("cannot split an empty batch dict")
        sizes = {key: batch_size(value) if isinstance(value, (Tensor, list, tuple)) else None
                 for key, value in batch.items()}
        bad = [key for key, size in sizes.items() if size is None]
        if bad:
            raise TypeError(f"batch field(s) {bad} are not tensors or lists: only per-row fields can be "
                            "split; pass per-call values as separate arguments")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields have different row counts: {sizes}")
        return next(iter(sizes.values()))
    raise TypeError(f"DP_SPLIT needs a batch (dict of tensors/lists, tensor or list) first, got "
                    f"{type(batch).__name__}")


def split_batch(batch: Any, n: int) -> list[Any]:
    """`n` equal row chunks in order (views of the batch's tensors)."""
    rows = batch_size(batch)
    if n < 1 or rows % n:
        raise ValueError(f"DP_SPLIT: a batch of {rows} rows does not split evenly over {n} ranks; "
                         f"pad it or choose a batch size that is a multiple of {n}")
    size = rows // n
    return [_rows(batch, i * size, (i + 1) * size) for i in range(n)]


def _rows(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, dict):
        return {key: _rows(value, start, stop) for key, value in batch.items()}
    return batch[start:stop]


def concat_batches(parts: Sequence[Any]) -> Any:
    """Inverse of `split_batch` on what the ranks return (see the module docstring)."""
    first = parts[0]
    if isinstance(first, dict):
        keys = list(first)
        for rank, part in enumerate(parts):
            if not isinstance(part, dict) or list(part) != keys:
                got = list(part) if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"DP_SPLIT: rank {rank} returned {got}, rank 0 returned keys {keys}")
        return {key: concat_batches([part[key] for part in parts]) for key in keys}
    if all(isinstance(p, Tensor) and p.dim() > 0 for p in parts):
        return torch.cat(list(parts))
    if all(isinstance(p, list) for p in parts):
        return [item for part in parts for item in part]
    if all(isinstance(p, tuple) for p in parts):
        return tuple(item for part in parts for item in part)
    if all(p is None for p in parts):
        return None
    return list(parts)


# --------------------------------------------------------------------------- modes

def _same_for_all(world: int, args: tuple, kwargs: dict, mesh: Sequence[MeshCoord]) -> PerRank:
    return [(args, kwargs)] * world


def _dp_split(world: int, args: tuple, kwargs: dict, mesh: Sequence[MeshCoord]) -> PerRank:
    if not args:
        raise TypeError("DP_SPLIT methods take the batch as their first positional argument")
    chunks = split_batch(args[0], mesh[0].dp_size)
    return [((chunks[coord.dp_rank], *args[1:]), kwargs) for coord in mesh]


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
