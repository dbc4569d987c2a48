"""Row operations on RL batches: the one place rows are selected, cut, joined or padded.

A *batch* is a dict whose values are per-row: tensors (rows along dim 0) or
lists/tuples (one item per row), keyed by the names in `data.fields`. A bare
tensor or list is a batch too. Every function here returns new dicts (tensor
values may be views of the input's) and never mutates its input.

Padding is explicit: `pad_rows` returns the padded batch *and* a mask of the
real rows, and a padded row of a training batch carries a zero RESPONSE_MASK
(`mask_padding`), so it adds nothing to a loss, a gradient or a token count.

`mini_batch_plan` draws the PPO mini-batches of one update once, for the
whole batch, from the step's key; each data-parallel replica trains on its
share of every global mini-batch. So the optimizer steps see the same rows
whatever the layout (docs/architecture.md, "Layout-invariant updates").
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor

from hybridflow.data import fields as F


class Rows:
    """Which rows, of values kept elsewhere (another process, Ray's object store): `sources` are opaque,
    hashable handles whose owner resolves them (`controller.transfer`), holding `counts` rows each; `index`
    [n] names each row by its position in the sources' rows laid end to end. The fields of one answer share
    one `Rows`, and every row operation here keeps them sharing it (one index for all of them)."""

    __slots__ = ("sources", "counts", "index")

    def __init__(self, sources: tuple, counts: tuple, index: Tensor):
        self.sources, self.counts, self.index = sources, counts, index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    def take(self, index: Tensor | slice) -> "Rows":
        picked = self.index[index]  # a slice is a view: copied, so its pickle holds its rows, not the parent's
        return Rows(self.sources, self.counts, picked.clone() if isinstance(index, slice) else picked)

    @staticmethod
    def join(parts: Sequence["Rows"]) -> "Rows":
        """The rows of `parts` one after another, over their sources (each kept once)."""
        sources, counts, where = [], [], {}
        for part in parts:
            for source, count in zip(part.sources, part.counts):
                if source not in where:
                    where[source] = sum(counts)
                    sources.append(source)
                    counts.append(count)
        index = []
        for part in parts:  # each part's position -> the joined position
            starts = torch.tensor([0, *part.counts]).cumsum(0)[:-1]
            shift = torch.tensor([where[s] for s in part.sources]) - starts
            owner = torch.bucketize(part.index.long(), starts[1:], right=True)
            index.append((part.index.long() + shift[owner]).to(part.index.dtype))
        return Rows(tuple(sources), tuple(counts), torch.cat(index) if index else torch.zeros(0, dtype=torch.int32))

    def __reduce__(self):
        return Rows, (self.sources, self.counts, self.index)


class RowsElsewhere:
    """A per-row field whose values are kept elsewhere: field `field` of `rows`' sources (None: each source is
    the value itself). Row operations treat it as any per-row field; a worker receiving one gets the
    values (`controller.transfer.fetch_remote_rows`)."""

    __slots__ = ("rows", "field")

    def __init__(self, rows: Rows, field: Optional[str] = None):
        self.rows, self.field = rows, field

    def __len__(self) -> int:
        return len(self.rows)

    def __reduce__(self):
        return RowsElsewhere, (self.rows, self.field)


def _shared(value: Any, memo: dict, op) -> Any:
    """`op` applied to a field's rows once per shared `Rows` (the fields of one answer stay sharing one)."""
    key = id(value.rows)
    if key not in memo:
        memo[key] = (value.rows, op(value.rows))  # the input kept alive: its id is not reused meanwhile
    return RowsElsewhere(memo[key][1], value.field)


def row_count(batch: Any) -> int:
    """Rows in a batch; every field of a dict batch must have the same count."""
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            raise ValueError("a 0-d tensor has no rows")
        return batch.shape[0]
    if isinstance(batch, (list, tuple, RowsElsewhere)):
        return len(batch)
    if isinstance(batch, dict):
        if not batch:
            raise ValueError("an empty batch dict has no rows")
        sizes = {key: row_count(value) if isinstance(value, (Tensor, list, tuple, RowsElsewhere)) else None
                 for key, value in batch.items()}
        bad = [key for key, size in sizes.items() if size is None]
        if bad:
            raise TypeError(f"batch field(s) {bad} are not tensors or lists: only per-row fields can be "
                            "split; pass per-call values as separate arguments")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields have different row counts: {sizes}")
        return next(iter(sizes.values()))
    raise TypeError(f"a batch is a dict of tensors/lists, a tensor or a list, not {type(batch).__name__}")


def select_fields(batch: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The named fields of `batch` that it holds (a field it lacks is left out)."""
    return {name: batch[name] for name in names if name in batch}


def tensor_fields(batch: dict[str, Any]) -> dict[str, Tensor]:
    """The per-row tensors of a batch (the list fields stay on the controller)."""
    return {k: v for k, v in batch.items() if isinstance(v, Tensor)}


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a batch (views of its tensors)."""
    cut = slice(start, stop)
    if isinstance(batch, dict):
        memo: dict = {}
        return {key: _shared(value, memo, lambda rows: rows.take(cut)) if isinstance(value, RowsElsewhere)
                else slice_rows(value, start, stop) for key, value in batch.items()}
    if isinstance(batch, RowsElsewhere):
        return RowsElsewhere(batch.rows.take(cut), batch.field)
    return batch[cut]


def take_rows(batch: Any, index: Tensor | Sequence[int]) -> Any:
    """The rows at `index` (a bool mask or integer indices), in that order; lists are indexed item by item."""
    index = torch.as_tensor(index)
    if index.dtype == torch.bool:
        index = index.nonzero().flatten()
    if isinstance(batch, dict):
        memo: dict = {}
        return {key: _shared(value, memo, lambda rows: rows.take(index)) if isinstance(value, RowsElsewhere)
                else take_rows(value, index) for key, value in batch.items()}
    if isinstance(batch, RowsElsewhere):
        return RowsElsewhere(batch.rows.take(index), batch.field)
    if isinstance(batch, Tensor):
        return batch[index.to(batch.device)]
    items = [batch[int(i)] for i in index]
    return tuple(items) if isinstance(batch, tuple) else items


def repeat_rows(batch: Any, n: int) -> Any:
    """Each row `n` times in a row, prompt-major (the generator's order for `n` samples of each prompt)."""
    return take_rows(batch, torch.arange(row_count(batch)).repeat_interleave(n))


def split_rows(batch: Any, n: int) -> list[Any]:
    """`n` equal consecutive row chunks (views); the rows must divide (pad first with `pad_rows`)."""
    rows = row_count(batch)
    if n < 1 or rows % n:
        raise ValueError(f"a batch of {rows} rows does not split evenly over {n} ranks; "
                         f"pad it or choose a batch size that is a multiple of {n}")
    size = rows // n
    return [slice_rows(batch, i * size, (i + 1) * size) for i in range(n)]


def chunk_rows(batch: Any, size: int) -> list[Any]:
    """Consecutive chunks of `size` rows (the last may be shorter)."""
    if size <= 0:
        raise ValueError(f"a chunk size must be positive, got {size}")
    rows = row_count(batch)
    return [slice_rows(batch, i, min(i + size, rows)) for i in range(0, rows, size)]


def chunk_by_tokens(batch: dict[str, Tensor], max_tokens: int) -> list[dict[str, Tensor]]:
    """Consecutive rows grouped so each group holds at most `max_tokens` real tokens (ATTENTION_MASK;
    verl's dynamic batch size, `ppo_max_token_len_per_gpu`); a longer row is a group of its own."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    lengths = batch[F.ATTENTION_MASK].sum(-1).tolist()
    bounds, used = [0], 0
    for i, n in enumerate(lengths):
        if used and used + n > max_tokens:
            bounds.append(i)
            used = 0
        used += n
    bounds.append(len(lengths))
    return [slice_rows(batch, a, b) for a, b in zip(bounds, bounds[1:])]


class Gathered(list):
    """One value per part, gathered by `concat` (not rows: padding is never stripped from it)."""


def concat(parts: Sequence[Any], name: str = "part") -> Any:
    """Inverse of `split_rows`: tensors `torch.cat`-ed, lists and tuples joined, field by field; values
    that are not per-row (floats, strings, 0-d tensors) are gathered into a `Gathered` list, an entry
    per part. `name` is what errors call a part (e.g. "rank")."""
    first = parts[0]
    if isinstance(first, dict):
        keys = list(first)
        for i, part in enumerate(parts):
            if not isinstance(part, dict) or list(part) != keys:
                got = list(part) if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{name} {i} returned {got}, {name} 0 returned keys {keys}")
        for key in keys:
            elsewhere = [isinstance(part[key], RowsElsewhere) for part in parts]
            if any(elsewhere) and not all(elsewhere):
                raise ValueError(f"field {key!r} is kept elsewhere in {name} {elsewhere.index(True)} and not in "
                                 f"{name} {elsewhere.index(False)}")
        memo: dict = {}
        return {key: _joined([part[key] for part in parts], memo) if isinstance(first[key], RowsElsewhere)
                else concat([part[key] for part in parts], name) for key in keys}
    if all(isinstance(p, RowsElsewhere) for p in parts):
        return _joined(parts, {})
    if all(isinstance(p, Tensor) and p.dim() > 0 for p in parts):
        return torch.cat(list(parts))
    if all(isinstance(p, list) for p in parts):
        return [item for part in parts for item in part]
    if all(isinstance(p, tuple) for p in parts):
        return tuple(item for part in parts for item in part)
    if all(p is None for p in parts):
        return None
    return Gathered(parts)


def _joined(parts: Sequence[Any], memo: dict) -> Any:
    """RowsElsewhere parts (the callers check that every part is one) joined: the fields that shared `Rows`
    in every part share the joined one."""
    fields = {p.field for p in parts}
    if len(fields) > 1:
        raise ValueError(f"the parts name different fields of the objects they keep elsewhere: "
                         f"{sorted(map(str, fields))}")
    key = tuple(id(p.rows) for p in parts)
    if key not in memo:
        memo[key] = ([p.rows for p in parts], Rows.join([p.rows for p in parts]))
    return RowsElsewhere(memo[key][1], parts[0].field)


def pad_rows(batch: Any, multiple: int) -> tuple[Any, Tensor]:
    """`batch` with its last row repeated until the rows are a multiple of `multiple`, and the mask of
    its real rows [rows']. An empty batch stays empty."""
    rows = row_count(batch)
    extra = -rows % multiple if rows else 0
    real = torch.ones(rows + extra, dtype=torch.bool)
    if extra == 0:
        return batch, real
    real[rows:] = False
    return take_rows(batch, torch.cat([torch.arange(rows), torch.full((extra,), rows - 1)])), real


def pad_with_empty_rows(batch: dict[str, Tensor], rows: int) -> dict[str, Tensor]:
    """Append all-zero rows (no real tokens, masks 0) to every tensor field until it has `rows` rows:
    pipeline micro-batches padded to one shape."""
    out = {}
    for key, value in batch.items():
        extra = rows - len(value)
        out[key] = torch.cat([value, value.new_zeros(extra, *value.shape[1:])]) if extra > 0 else value
    return out


def mask_padding(batch: dict[str, Any], real: Tensor) -> dict[str, Any]:
    """A training batch whose padded rows (`real` False) count nowhere: RESPONSE_MASK and ADVANTAGES are
    zero on them, so they add nothing to a loss, its gradient or its token count."""
    if bool(real.all()):
        return batch
    out = dict(batch)
    for name in (F.RESPONSE_MASK, F.ADVANTAGES):
        if name in out:
            out[name] = out[name] * real.view(-1, *([1] * (out[name].dim() - 1))).to(out[name].dtype)
    return out


def unpad(answer: Any, real: Tensor) -> Any:
    """The real rows of a per-row answer to a padded batch."""
    return answer if bool(real.all()) else take_rows(answer, real)


# --------------------------------------------------------------------------- mini-batches

def mini_batch_plan(rows: int, size: int, epochs: int, replicas: int,
                    generator: Optional[torch.Generator]) -> list[list[Tensor]]:
    """Which rows each data-parallel replica trains on at each optimizer step of one update.

    Each epoch draws one permutation of the `rows` rows (`generator`; None keeps
    their order) and cuts it into global mini-batches of `size` rows (the last
    may be shorter); replica r takes the r-th consecutive share of each, padded
    with -1 (a slot `mini_batch_rows` masks) so every replica runs every step.
    Returns plan[replica][step] -> LongTensor of row indices.

    The layout enters only through `replicas`, and a step's shares together are
    its global mini-batch, so every layout trains on the one-process
    mini-batches (and micro-batches, where the micro-batch size divides a share).
    """
    if size <= 0 or replicas <= 0 or epochs < 0:
        raise ValueError(f"mini-batch size {size}, replicas {replicas} and epochs {epochs} must be positive")
    plan: list[list[Tensor]] = [[] for _ in range(replicas)]
    for _ in range(epochs):
        order = torch.randperm(rows, generator=generator) if generator is not None else torch.arange(rows)
        for start in range(0, rows, size):
            mini = order[start:start + size]
            share = -(-len(mini) // replicas)
            padded = torch.cat([mini, mini.new_full((share * replicas - len(mini),), -1)])
            for r in range(replicas):
                plan[r].append(padded[r * share:(r + 1) * share])
    return plan


def rows_for_plan(batch: dict[str, Any], steps: list[Tensor]) -> tuple[dict[str, Any], list[Tensor]]:
    """What one replica needs of `batch` for its `steps` (a `mini_batch_plan` entry): the rows it uses,
    each once, and the steps renumbered into those rows (-1 stays padding). A replica receives only this."""
    flat = torch.cat(steps) if steps else torch.zeros(0, dtype=torch.long)
    used = torch.unique(flat[flat >= 0])
    local = torch.full((row_count(batch),), -1, dtype=torch.long)
    local[used] = torch.arange(len(used))
    if used.numel() == 0:  # only padding here: one row to mask, so the replica still runs every step
        used = torch.zeros(1, dtype=torch.long)
    return take_rows(batch, used), [torch.where(s >= 0, local[s.clamp(min=0)], s) for s in steps]


def mini_batch_rows(batch: dict[str, Tensor], index: Tensor) -> dict[str, Tensor]:
    """One step's rows of a replica's batch; padding slots (-1) become masked copies of row 0."""
    real = index >= 0
    return mask_padding(take_rows(batch, index.clamp(min=0)), real)
