"""A training layout `p-t-d` (plus `c`) as plain data: degrees, rank <-> coordinates, named groups.

Ranks are ordered as megatron-core orders them by default ("tp-cp-ep-dp-pp",
expert parallelism being 1 here): tensor-parallel peers are consecutive
ranks, then context, then data parallel, and pipeline stages are farthest
apart:

    rank = tp + t * (cp + c * (dp + d * pp))

So with t=2, p=2, d=2 the TP groups are [0,1] [2,3] [4,5] [6,7], the DP
groups [0,2] [1,3] [4,6] [5,7] and the pipelines [0,4] [1,5] [2,6] [3,7].

A `ParallelDims` is built once per role, in the run plan
(`config/plan.py`), from its config section and the number of processes
the role runs on, and is passed to whatever needs groups (the engine,
layout-aware dispatch, the 3D-HybridEngine's plan); nothing recomputes rank
arithmetic elsewhere. Whether a config's degrees fit its processes and its
model is a config check (`config/validate.py`): this module imports no
config. It is pure Python, imports no torch.distributed and is tested
without processes.

Group names (`GROUPS`): "tp", "cp", "dp", "pp", and "mp" (model parallel:
the tp x cp x pp ranks that together hold one replica). The generation
layout of the 3D-HybridEngine adds its own (generation TP, micro-DP) on top
of these coordinates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DIMS = ("tp", "cp", "dp", "pp")  # fastest-varying first
GROUPS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "mp": ("tp", "cp", "pp"),
}


@dataclass(frozen=True)
class Coord:
    """Where one rank sits in a layout."""

    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of a layout; `world_size = tp * cp * dp * pp`."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @staticmethod
    def data_parallel_size(world: int, *, tp: int = 1, pp: int = 1, cp: int = 1) -> Optional[int]:
        """The dp that `world` processes leave at these model-parallel degrees; None where tp*pp*cp does not
        divide the world. The one place that asks (config checks, the engine, the planner's search)."""
        model_parallel = tp * pp * cp
        if model_parallel < 1 or world < 1 or world % model_parallel:
            return None
        return world // model_parallel

    @classmethod
    def for_world(cls, world: int, *, tp: int = 1, pp: int = 1, cp: int = 1) -> "ParallelDims":
        """The layout of `world` processes at the given model-parallel degrees; dp is what is left.

        A config whose degrees do not divide its role's processes never gets here: `config/validate.py`
        refuses it, naming the key.
        """
        dp = cls.data_parallel_size(world, tp=tp, pp=pp, cp=cp)
        if dp is None:
            raise ValueError(f"tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} does not divide a world of {world}")
        return cls(tp=tp, pp=pp, dp=dp, cp=cp)

    # -- sizes and coordinates ------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.cp * self.pp

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ({self})")

    def coord(self, rank: int) -> Coord:
        self._check_rank(rank)
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return Coord(tp=tp, cp=cp, dp=dp, pp=pp)

    def rank(self, coord: Coord) -> int:
        for name in DIMS:
            if not 0 <= getattr(coord, name) < getattr(self, name):
                raise ValueError(f"{coord} is outside {self}")
        return coord.tp + self.tp * (coord.cp + self.cp * (coord.dp + self.dp * coord.pp))

    # -- groups ---------------------------------------------------------------
    def span(self, name: str) -> int:
        """How many consecutive ranks a block holding whole groups `name` covers: the product of the degrees
        up to the group's slowest dimension (tp: t; cp: t*c; dp: t*c*d; pp and mp: the world). A group
        whose block fits in a node talks over the node's links (the planner's cost model)."""
        dims = _dims_of(name)
        slowest = max(DIMS.index(d) for d in dims)
        return math.prod(getattr(self, d) for d in DIMS[:slowest + 1])

    def group(self, name: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group `name` (see GROUPS), in rank order."""
        dims = _dims_of(name)
        here = self.coord(rank)
        return [r for r in range(self.world_size)
                if all(getattr(self.coord(r), d) == getattr(here, d) for d in DIMS if d not in dims)]

    def groups(self, name: str) -> list[list[int]]:
        """Every group `name` of the layout; together they partition the world."""
        seen: set[int] = set()
        out = []
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.group(name, rank)
                seen.update(members)
                out.append(members)
        return out

    # -- one answer per data-parallel replica ----------------------------------
    def answers_for_replica(self, rank: int) -> bool:
        """Whether `rank` answers for its DP replica: the last pipeline stage, TP and CP rank 0.

        That rank holds the replica's outputs (logits, values, losses) after
        the forward pass; its TP, CP and earlier-stage peers hold copies or
        nothing.
        """
        c = self.coord(rank)
        return c.tp == 0 and c.cp == 0 and c.pp == self.pp - 1

    def replica_ranks(self) -> list[int]:
        """The answering rank of each DP replica, in DP order."""
        last = self.pp - 1
        return [self.rank(Coord(tp=0, cp=0, dp=d, pp=last)) for d in range(self.dp)]

    def __str__(self) -> str:
        text = f"p{self.pp}-t{self.tp}-d{self.dp}"
        return text + (f"-c{self.cp}" if self.cp > 1 else "")


def _dims_of(name: str) -> tuple[str, ...]:
    if name not in GROUPS:
        raise KeyError(f"unknown group {name!r}; groups are {sorted(GROUPS)}")
    return GROUPS[name]
