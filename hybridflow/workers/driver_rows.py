"""Which fields of a batch stay off the driver: one rule for the data plane and for the driver's own stages.

The rule (`off_driver`): a worker's token tensors ([B, R] and wider) and texts (`TEXT_FIELDS`). Under Ray
(trainer.data_plane=object_store) a worker leaves them in the object store (`token_rows`) and the driver
holds placeholders (`data.batch.RowsElsewhere`); in-process it holds the values. The driver's own stages
see a batch through `DriverBatch`, which refuses to read such a field in both cases, so a stage that
computes on token rows fails in an in-process test exactly as it would under Ray. Handing fields on to a
worker (`hand_on`, a group call) or cutting rows (`data.batch` row operations) is not reading them.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from hybridflow.controller.transfer import remote_fields
from hybridflow.data import fields as F
from hybridflow.data.batch import RowsElsewhere
from hybridflow.workers.specs import Run

# The per-row lists of a rollout the driver does not read once the rollout has scored them: the texts (a reward
# model's group fetches them from the store) and what the rule reward read beside them.
TEXT_FIELDS = (F.PROMPT_TEXT, F.RESPONSE_TEXT, F.DATA_SOURCE, F.GROUND_TRUTH, F.EXTRA_INFO)


def off_driver(name: str, value: Any) -> bool:
    """Whether field `name` holding `value` is one the driver never computes on (module docstring)."""
    return isinstance(value, RowsElsewhere) or name in TEXT_FIELDS or \
        (isinstance(value, torch.Tensor) and value.dim() >= 2)


def token_rows(out: dict[str, Any], run: Run, answers: bool = True) -> dict[str, Any]:
    """`out` (a worker's per-row answer) with its `off_driver` fields left in the object store, one object for
    them all (each a `RowsElsewhere`), when the run keeps them there (`Run.rows_in_object_store`) and this
    rank's answer is the one the caller gets. Without Ray they stay as they are."""
    if not (run.rows_in_object_store and answers):
        return out
    left = {k: v for k, v in out.items() if off_driver(k, v)}
    return {**out, **remote_fields(left)}  # the fields' order kept


class DriverFieldError(LookupError):
    """A driver-side stage read a field that stays off the driver."""


class DriverBatch(dict):
    """A batch as the driver's own stages see it: reading an `off_driver` field raises `DriverFieldError`,
    whether it holds a tensor (in-process) or a placeholder (under Ray)."""

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if off_driver(name, value):
            raise DriverFieldError(
                f"a driver-side stage read {name!r}: token tensors and texts stay with the workers (under Ray "
                "the driver holds only a placeholder); compute on them in a worker (roles/preparation.py) and "
                "hand them on with workers.driver_rows.hand_on")
        return value

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def pop(self, name: str, *default: Any) -> Any:
        if name in self:
            self[name]  # the same refusal as a read
        return super().pop(name, *default)


def hand_on(batch: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The named fields `batch` holds, as a plain dict for a worker, without reading them here."""
    return {name: dict.__getitem__(batch, name) for name in names if name in batch}
