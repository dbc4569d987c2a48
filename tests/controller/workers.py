"""Worker classes for the controller tests (importable by Ray actors and torchrun ranks)."""
import os
import time

import torch
import torch.distributed as dist

from hybridflow.controller import Dispatch, Worker, register


def double_batch(batch: dict) -> dict:
    """The transformation the DP_SPLIT tests expect back, row by row."""
    return {"x": batch["x"] * 2, "names": [name.upper() for name in batch["names"]]}


def _raise_from_worker(rank: int):
    raise ValueError(f"bad value on rank {rank}")


_ECHOES: list = []  # weak references to this process's Echo workers (`alive_echoes`)


class Echo(Worker):
    def __init__(self, offset: int = 0):
        import weakref

        self.offset = offset
        self.init_rank = self.rank  # the context is in place before __init__
        self.cycle = {"worker": self}  # a reference cycle: only the collector frees this worker
        _ECHOES.append(weakref.ref(self))

    @register(Dispatch.ONE_TO_ALL)
    def alive_echoes(self) -> dict:
        """Echo workers still alive in this process (this one included), and the objects `gc.freeze` put out
        of the collector's reach."""
        import gc

        return {"alive": sum(ref() is not None for ref in _ECHOES), "frozen": gc.get_freeze_count()}

    @register(Dispatch.DP_SPLIT)
    def double(self, batch: dict, extra: int = 0) -> dict:
        out = double_batch(batch)
        out["x"] = out["x"] + extra
        out["rank"] = [self.rank] * len(batch["names"])
        return out

    @register(Dispatch.DP_SPLIT, reads=("x", "names"))
    def double_read(self, batch: dict) -> dict:
        """`double` of a method that declares what it reads: it fails if more fields arrive."""
        assert sorted(batch) == ["names", "x"], sorted(batch)
        return {**double_batch(batch), "fields": [sorted(batch)] * len(batch["names"])}

    @register(Dispatch.DP_SPLIT)
    def share(self, rows: dict, steps: list) -> dict:
        """What a replica received of PerReplica arguments, as one row."""
        return {"names": [rows["names"]], "steps": [steps]}

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
        return {"rank": self.rank, "init_rank": self.init_rank, "world": self.world_size, "offset": self.offset,
                "env": {k: os.environ.get(k) for k in keys}}

    @register(Dispatch.ONE_TO_ALL)
    def hold(self, path: str, seconds: float = 60.0) -> float:
        """Busy on the ordinary lane until the file `path` exists (at most `seconds`); how long it waited."""
        start = time.monotonic()
        while not os.path.exists(path) and time.monotonic() - start < seconds:
            time.sleep(0.01)
        return time.monotonic() - start

    @register(Dispatch.ONE_TO_ALL, aside=True)
    def release(self, path: str) -> int:
        """Aside: create `path` (ending a `hold` in progress, if this runs beside it); this process's id."""
        open(path, "w").close()
        return os.getpid()

    @register(Dispatch.RANK_ZERO)
    def tag(self) -> str:
        return f"rank{self.rank}"

    @register(Dispatch.ALL_TO_ALL)
    def add(self, a: int, b: int = 0) -> int:
        return a + b + 100 * self.rank

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        """Sum of value * (rank + 1) over the group's gloo process group."""
        group = self.init_process_group()
        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t, group=group)
        return t.item()

    @register(Dispatch.ONE_TO_ALL)
    def mesh_coordinate(self) -> tuple:
        """This rank's coordinate in a device mesh over the world (as the FSDP engines build it)."""
        from hybridflow.engine.fsdp import world_mesh

        return world_mesh("cpu").get_coordinate()

    @register(Dispatch.ONE_TO_ALL)
    def gather_ranks(self) -> list:
        group = self.init_process_group()
        out = [None] * self.world_size
        dist.all_gather_object(out, self.rank, group=group)
        return out

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            _raise_from_worker(rank)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def write_to_a_full_disk(self, path: str) -> None:
        """A write the machine refuses, wrapped as a library would wrap it."""
        import errno

        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        except OSError as exc:
            raise RuntimeError("saving the shard failed") from exc

    @register(Dispatch.ONE_TO_ALL)
    def exit_on(self, rank: int) -> int:
        """`rank` exits hard; the others wait in a collective that can never complete."""
        self.init_process_group()
        if self.rank == rank:
            os._exit(1)
        dist.barrier()
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def span(self, seconds: float) -> tuple[float, float]:
        """When this call ran: (start, end) on this process's monotonic clock."""
        start = time.monotonic()
        time.sleep(seconds)
        return start, time.monotonic()

    def not_exposed(self):
        return "only registered methods reach the group"


class BrokenInit(Worker):
    def __init__(self):
        if self.rank == 1:
            raise RuntimeError("cannot build the model on this rank")


class Publisher(Worker):
    """Leaves a tensor in the object store and returns only the handle."""

    @register(Dispatch.RANK_ZERO)
    def publish(self, rows: int):
        from hybridflow.controller import ObjectHandle

        return ObjectHandle(torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024))


class RowSource(Worker):
    """Generates a batch per rank and leaves its "ids" rows in the object store (as a rollout group apart does)."""

    @register(Dispatch.DP_SPLIT)
    def make(self, offsets: torch.Tensor) -> dict:
        from hybridflow.controller.transfer import remote_rows

        ids = offsets.view(-1, 1) * 1000 + torch.arange(256).view(1, -1)  # rows of 256 int64
        return {"ids": remote_rows(ids), "mask": torch.ones(len(offsets), 2, dtype=torch.long)}


class Receiver(Worker):
    @register(Dispatch.DP_SPLIT)
    def rows_back(self, batch: dict) -> dict:
        """The rows it received, as tensors (fetched from the object store before this runs)."""
        assert isinstance(batch["ids"], torch.Tensor), type(batch["ids"])
        return {"ids": batch["ids"] + 0, "pid": [os.getpid()] * len(batch["ids"])}

    @register(Dispatch.ONE_TO_ALL)
    def dtypes(self, batch: dict) -> dict:
        return {key: str(value.dtype) for key, value in batch.items()}

    @register(Dispatch.ONE_TO_ALL)
    def checksum(self, handle) -> tuple[int, float]:
        value = handle.get()
        return os.getpid(), float(value.sum())


class Meeting(Worker):
    """One side of a rendezvous spanning two groups (as the weight sync's): `serve_address` on the serving
    side, `meet` on both; `fail` stands for a side that fails before it serves."""

    @register(Dispatch.ONE_TO_ALL)
    def serve_address(self) -> tuple[str, int]:
        from hybridflow.parallel.process_group import free_port

        return self.context.master_addr, free_port(self.context.master_addr)

    @register(Dispatch.ONE_TO_ALL)
    def meet(self, address: str, port: int, rank: int, world: int) -> int:
        from hybridflow.parallel.process_group import rendezvous_store

        store = rendezvous_store(address, port, rank, world)
        store.set(f"here/{rank}", "1")
        store.wait([f"here/{r}" for r in range(world)])
        return rank

    @register(Dispatch.ONE_TO_ALL)
    def fail(self) -> None:
        raise ValueError("failed before serving the rendezvous")
