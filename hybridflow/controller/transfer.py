"""Values handed from one worker group to another through the Ray object store, not the driver.

    # in a worker of group A
    @register(Dispatch.RANK_ZERO)
    def publish_weights(self):
        return ObjectHandle(self.engine.generation_state())

    # on the controller: only the handle (a reference, a few bytes) passes through
    rollout_group.load_weights(actor_group.publish_weights())

    # in a worker of group B
    def load_weights(self, handle):
        self.model.load_state_dict(handle.get())

Under Ray, `ObjectHandle(value)` puts the value into the object store once, in
the process that creates it (which then owns it); the handle carries only the
reference. A worker that calls `get()` fetches the value from the owner's
node directly, so a large value is never deserialised on the driver. Without
Ray (a `LocalWorkerGroup`, where the worker is in the driver's process or
every rank drives itself) the handle simply holds the value.
"""
from __future__ import annotations

import sys
from typing import Any


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class ObjectHandle:
    """A value left in the object store by the process that made it; `get()` reads it anywhere."""

    def __init__(self, value: Any):
        self._ref, self._value = None, None
        if _ray_running():
            import ray

            self._ref = ray.put(value)
        else:
            self._value = value

    @property
    def in_object_store(self) -> bool:
        return self._ref is not None

    def get(self) -> Any:
        if self._ref is None:
            return self._value
        import ray

        return ray.get(self._ref)

    def __repr__(self) -> str:
        where = f"object {self._ref.hex()[:12]}" if self._ref is not None else "in-process value"
        return f"ObjectHandle({where})"
