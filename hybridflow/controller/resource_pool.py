"""Resource pools: the devices a worker group runs on, one process per device index.

`pools_from_placement(placement, device)` turns the placement (role -> device
indices, as the trainer resolves the `placement:` section) into pools. Roles
listing the same device set share ONE pool, and so one worker group — the
hybrid layout where actor, rollout and reference live in the same processes;
different sets are split placement, one group each. Sets may overlap (docs/api.md:
rollout [0, 1], training [0, 1, 2, 3]); then each process on a shared device
asks for its share of it (1/k for k pools), so all of them fit.

What a device is:
- "cuda": one GPU. The first group created on any pool of a placement
  reserves one Ray placement-group bundle {GPU: 1, CPU: 1} per device index
  (PACK: one node when it fits), and device index i always maps to bundle i,
  so colocated pools land on the same GPUs. Ray then sets each actor's
  CUDA_VISIBLE_DEVICES to its one GPU.
- "cpu": one CPU process holding (its share of) one logical CPU; there is no
  physical device to pin, so no placement group is needed.

A pool holds no processes and needs no Ray until a `RayWorkerGroup` uses it;
`LocalWorkerGroup` only reads its size and device kind.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

PLACEMENT_TIMEOUT_S = 60.0


class _Reservation:
    """One Ray placement group: bundle i <-> device index i (GPU pools only)."""

    def __init__(self, devices: Sequence[int]):
        self.devices = sorted(devices)
        self._pg = None

    def bundle(self, device_index: int) -> tuple[object, int]:
        if self._pg is None:
            self._pg = self._reserve()
        return self._pg, self.devices.index(device_index)

    def _reserve(self):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group([{"GPU": 1, "CPU": 1} for _ in self.devices], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(pg)
            raise RuntimeError(
                f"could not reserve {len(self.devices)} GPU(s) (devices {self.devices}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f}s; the Ray cluster has {ray.cluster_resources()}, of which "
                f"{ray.available_resources()} are free")
        return pg

    def release(self) -> None:
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None


class ResourcePool:
    """The devices of one worker group: rank r runs on `devices[r]`.

    devices: device indices (GPUs of the job, or CPU process slots).
    device: "cpu" or "cuda".
    share: how many pools use each device index (default 1 each); a process
        asks for 1/share of its device. Set by `pools_from_placement`.
    """

    def __init__(self, devices: Sequence[int], device: str = "cpu", *, share: Optional[dict[int, int]] = None,
                 reservation: Optional[_Reservation] = None):
        devices = list(devices)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if not devices:
            raise ValueError("a resource pool needs at least one device")
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in devices):
            raise ValueError(f"device indices must be integers >= 0, got {devices}")
        if len(set(devices)) != len(devices):
            raise ValueError(f"a device is listed twice: {devices}")
        self.devices = devices
        self.device = device
        self._share = dict(share or {})
        self._reservation = reservation if reservation is not None or device == "cpu" else _Reservation(devices)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def fraction(self, rank: int) -> float:
        """The share of its device that rank `rank` asks Ray for."""
        return 1.0 / self._share.get(self.devices[rank], 1)

    def actor_options(self, rank: int) -> dict:
        """Ray actor options placing rank `rank` on its device (reserves GPUs on first use)."""
        share = self.fraction(rank)
        if self.device == "cpu":
            return {"num_cpus": share, "num_gpus": 0}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, bundle = self._reservation.bundle(self.devices[rank])
        return {"num_cpus": share, "num_gpus": share,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle)}

    def release(self) -> None:
        """Give back the GPUs reserved for this pool (and the pools sharing its placement)."""
        if self._reservation is not None:
            self._reservation.release()

    def __repr__(self) -> str:
        return f"ResourcePool(devices={self.devices}, device={self.device!r})"


def pools_from_placement(placement: Mapping[str, Sequence[int]], device: str) -> dict[str, ResourcePool]:
    """role -> pool; roles with the same device set get the same pool object.

    placement: role -> the device indices it runs on, already resolved (an
        empty `placement:` list is every device: `config.plan.devices_for`)
        and checked when the config was loaded (`config/validate.py`).
    device: "cpu" or "cuda" (`trainer.device`).
    Call `release()` on any pool at the end of a GPU job to return the GPUs.
    """
    placed = {role: list(devices) for role, devices in placement.items()}
    device_sets = sorted({tuple(sorted(devices)) for devices in placed.values()})
    share: dict[int, int] = {}
    for devices in device_sets:
        for d in devices:
            share[d] = share.get(d, 0) + 1
    reservation = _Reservation(sorted(share)) if device == "cuda" else None
    pools = {devices: ResourcePool(devices, device, share=share, reservation=reservation)
             for devices in device_sets}
    return {role: pools[tuple(sorted(devices))] for role, devices in placed.items()}
