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
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

_ATTR = "__hybridflow_dispatch__"

PerRank = list[tuple[tuple, dict]]  # (args, kwargs) for each rank, rank order


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    RANK_ZERO = "rank_zero"
    DP_SPLIT = "dp_split"
    ALL_TO_ALL = "all_to_all"


def register(mode: Dispatch | str) -> Callable:
    """Tag a worker method with its dispatch mode; the group exposes tagged methods only."""
    mode = _as_mode(mode)

    def tag(fn: Callable) -> Callable:
        setattr(fn, _ATTR, mode)
        return fn

    return tag


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

def _same_for_all(world: int, args: tuple, kwargs: dict) -> PerRank:
    return [(args, kwargs)] * world


def _dp_split(world: int, args: tuple, kwargs: dict) -> PerRank:
    if not args:
        raise TypeError("DP_SPLIT methods take the batch as their first positional argument")
    chunks = split_batch(args[0], world)
    return [((chunk, *args[1:]), kwargs) for chunk in chunks]


def _all_to_all(world: int, args: tuple, kwargs: dict) -> PerRank:
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for what, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != world:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"ALL_TO_ALL: {what} must be a list with one value per rank ({world}), got {got}")
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world)]


@dataclass(frozen=True)
class _Rule:
    split: Callable[[int, tuple, dict], PerRank]
    collect: Callable[[list], Any]


_MODES: dict[Dispatch, _Rule] = {
    Dispatch.ONE_TO_ALL: _Rule(_same_for_all, list),
    Dispatch.RANK_ZERO: _Rule(_same_for_all, lambda results: results[0]),
    Dispatch.DP_SPLIT: _Rule(_dp_split, concat_batches),
    Dispatch.ALL_TO_ALL: _Rule(_all_to_all, list),
}


def dispatch(mode: Dispatch, world: int, args: tuple, kwargs: dict) -> PerRank:
    """(args, kwargs) for each of `world` ranks."""
    return _MODES[mode].split(world, tuple(args), dict(kwargs))


def collect(mode: Dispatch, results: list) -> Any:
    """What the caller gets from the ranks' results (rank order)."""
    return _MODES[mode].collect(list(results))
