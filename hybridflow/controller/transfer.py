"""How values travel between the driver and Ray workers, and from one worker group to another.

Tensors (`pack` / `unpack`): a CPU tensor inside an argument or a result goes
as a numpy view (`_Array`). Ray writes numpy arrays out of band (pickle
protocol 5) straight into the call or the object store, and the receiver
maps them without a copy, where a pickled torch tensor costs a copy on the
sender and, for a view such as a DP chunk, ships the whole storage it views.
The receiver copies an array once out of the read-only object store before
handing it to code that may write it (`unpack`), except where the next step
copies anyway (`unpack_results`, before `concat_batches`). What does not survive
the trip: `requires_grad`, and aliasing (a tensor passed twice arrives as two).

Handles (`ObjectHandle`), for values handed from one worker group to another
through the object store, not the driver:

    # in a worker of group A
    @register(Dispatch.RANK_ZERO)
    def publish(self):
        return ObjectHandle(self.state())

    # on the controller: only the handle (a reference, a few bytes) passes through
    group_b.load(group_a.publish())

    # in a worker of group B
    def load(self, handle):
        self.model.load_state_dict(handle.get())

Rows left in the object store (`remote_fields`, `remote_rows`), for batch
fields the driver never reads: a worker puts its answer's tensor fields (or
list fields, such as the texts) into the store as one object and returns
each field as a `RowsElsewhere` (`data.batch`: the object's reference and a
row index, 4 bytes a row, shared by the answer's fields), which every batch
operation on the driver treats as a per-row field (select, cut, join, pad).
A worker that receives one in a call gets the values back
(`fetch_remote_rows`: the referenced objects fetched together, each once,
from the process that put them, and the rows taken in order), so the rows
travel from one worker group to another without passing the driver.

Under Ray, `ObjectHandle(value)` puts the value into the object store once, in
the process that creates it (which then owns it); the handle carries only the
reference. A worker that calls `get()` fetches the value from the owner's
node directly, so a large value is never deserialised on the driver. Without
Ray (a `LocalWorkerGroup`, where the worker is in the driver's process or
every rank drives itself) the handle simply holds the value.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

from hybridflow.data.batch import Rows, RowsElsewhere


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class _Array:
    """A CPU tensor as a numpy array; dtypes numpy lacks (bfloat16) travel as same-width integers."""

    __slots__ = ("array", "dtype")

    def __init__(self, tensor):
        self.dtype = tensor.dtype
        t = tensor.detach().resolve_neg()
        self.array = (t.view(_INT_OF[t.dtype]) if t.dtype in _INT_OF else t).numpy()

    def tensor(self, own: bool = True):
        """The tensor again. `own`: copied out of a read-only (object-store) buffer, so it may be
        written; `own=False` only for a tensor that is read once and dropped (concatenated)."""
        import torch

        array = self.array.copy() if own and not self.array.flags.writeable else self.array
        with warnings.catch_warnings():  # torch warns about read-only arrays; own=False is never written
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(array)
        return t if t.dtype == self.dtype else t.view(self.dtype)


_INT_OF: dict = {}  # dtype -> the same-width integer dtype it travels as (filled on first use)
_NUMPY_OK: frozenset = frozenset()


def _init_dtypes() -> None:
    global _INT_OF, _NUMPY_OK
    import torch

    _INT_OF = {torch.bfloat16: torch.int16}
    _NUMPY_OK = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                           torch.int64, torch.uint8, torch.bool, *_INT_OF})


def pack(value: Any) -> Any:
    """`value` with every CPU tensor inside dicts, lists and tuples wrapped as an `_Array`."""
    import torch

    if not _NUMPY_OK:
        _init_dtypes()
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.dim() > 0 and value.layout == torch.strided \
                and value.dtype in _NUMPY_OK:
            return _Array(value)
        return value
    if type(value) is dict:
        return {k: pack(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(pack(v) for v in value)
    return value


def unpack(value: Any) -> Any:
    """Inverse of `pack`; every tensor owns (writable) memory."""
    if isinstance(value, _Array):
        return value.tensor()
    if type(value) is dict:
        return {k: unpack(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(unpack(v) for v in value)
    return value


def remote_rows(value) -> Any:
    """A tensor [B, ...] or a list of B items (texts) put into the object store once, as a `RowsElsewhere`;
    the value itself without Ray."""
    if not _ray_running():
        return value
    import ray

    return RowsElsewhere(_rows_of_one(ray.put(pack(value)), len(value)))


def remote_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Per-row fields (tensors [B, ...], lists of B) put into the object store as *one* object, each field a
    `RowsElsewhere` naming it, all sharing one `Rows`: one put for a worker's whole answer, one fetch for a
    receiver, and one row index on the driver for all of them (a put or a get has a fixed cost whatever
    its size, and a reference per row and field would cost more than a small batch's rows). The fields
    themselves without Ray."""
    if not fields or not _ray_running():
        return fields
    import ray

    rows = _rows_of_one(ray.put(pack(fields)), len(next(iter(fields.values()))))
    return {name: RowsElsewhere(rows, name) for name in fields}


def _rows_of_one(ref, count: int) -> Rows:
    import torch

    return Rows((ref,), (count,), torch.arange(count, dtype=torch.int32))


def fetch_remote_rows(value: Any) -> Any:
    """`value` (a worker's call arguments, unpacked) with every `RowsElsewhere` replaced by its tensor (or
    list): the objects they reference fetched together, each once."""
    refs: dict[Any, None] = {}
    _collect_sources(value, refs)
    if not refs:
        return value
    import ray

    names = list(refs)
    objects = dict(zip(names, unpack_results(ray.get(names))))
    return _replace_rows(value, objects)


def _collect_sources(value: Any, refs: dict) -> None:
    if isinstance(value, RowsElsewhere):
        refs.update(dict.fromkeys(value.rows.sources))
    elif type(value) is dict:
        for v in value.values():
            _collect_sources(v, refs)
    elif type(value) in (list, tuple):
        for v in value:
            _collect_sources(v, refs)


def _replace_rows(value: Any, objects: dict) -> Any:
    if isinstance(value, RowsElsewhere):
        return _values_of(value, objects)
    if type(value) is dict:
        return {k: _replace_rows(v, objects) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_replace_rows(v, objects) for v in value)
    return value


def _values_of(field: RowsElsewhere, objects: dict) -> Any:
    """The rows `field` names, in its order, out of the fetched `objects` (read-only views of the store: the
    gather below copies them into a tensor of its own)."""
    import torch

    parts = [objects[s] if field.field is None else objects[s][field.field] for s in field.rows.sources]
    index = field.rows.index.long()
    if isinstance(parts[0], list):
        flat = [item for part in parts for item in part]
        return [flat[i] for i in index.tolist()]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts)
    return whole[index]


def unpack_results(parts: list) -> list:
    """The ranks' DP_SPLIT results for `concat_batches`. What it will `torch.cat` (the results
    themselves, or a field every rank returned as a tensor) stays a read-only view of the object
    store, since the concatenation copies it anyway; everything else is unpacked as usual."""
    if all(isinstance(p, _Array) for p in parts):
        return [p.tensor(own=False) for p in parts]
    if not all(type(p) is dict and p.keys() == parts[0].keys() for p in parts):
        return [unpack(p) for p in parts]
    views = {k for k in parts[0] if all(isinstance(p[k], _Array) for p in parts)}
    return [{k: v.tensor(own=False) if k in views else unpack(v) for k, v in p.items()} for p in parts]


class ObjectHandle:
    """A value left in the object store by the process that made it; `get()` reads it anywhere.

    Its tensors travel as `pack` sends them (a CPU tensor is written into the
    store once, with no pickled copy; `get()` returns tensors that own their
    memory); in-process the handle holds the value itself.
    """

    def __init__(self, value: Any):
        self._ref, self._value = None, None
        if _ray_running():
            import ray

            self._ref = ray.put(pack(value))
        else:
            self._value = value

    @property
    def in_object_store(self) -> bool:
        return self._ref is not None

    def get(self) -> Any:
        if self._ref is None:
            return self._value
        import ray

        return unpack(ray.get(self._ref))

    def __repr__(self) -> str:
        where = f"object {self._ref.hex()[:12]}" if self._ref is not None else "in-process value"
        return f"ObjectHandle({where})"
