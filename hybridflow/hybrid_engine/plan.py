"""The 3D-HybridEngine's reshard plan, as plain data (docs/design.md §3).

`plan_reshard(params, train, gen, grouping)` is a pure function of the
parameters' full shapes and sharding rules, the training layout `p-t-d`, the
generation layout `pg-tg` and a grouping. It returns every rank's groups in
the generation layout and, per parameter, which piece each rank holds after
training, which pieces it needs to generate, and which pieces it receives
from whom, with byte counts. `reshard.GroupedWeights` runs it with
collectives (and is tested to move exactly these bytes); the planner itself
is tested without processes.

Pieces. A parameter sharded over TP is cut into `t * blocks` pieces: piece
`(r, b)` is block `b` of training TP rank `r`'s shard (`blocks = 2` for the
SwiGLU `[gate; up]` weight, 1 otherwise, as in `models/sharding.py`). The
generation shard `j` of `tg` is, block by block, the pieces of training TP
ranks `j*k .. j*k + k - 1` (`k = t / tg`): for `[gate; up]` that is
`[gate_r...; up_r...]`, a re-laying, not the concatenation of whole
training shards. Grouped-query QKV needs no re-laying: Megatron keeps each
query group contiguous, so a TP shard is whole groups. A replicated tensor
(norms) is one piece every TP rank holds. Pipeline stages hold whole layers:
training stage `layer // (L / p)`, generation stage `layer // (L / pg)`;
embeddings on the first stage, the final norm and output layer on the last.

Groupings (micro-DP group = the ranks of one replica that gather among
themselves; `dg = t*p / (tg*pg)` of them per generation group):

- `hybridflow` (the paper's): a generation TP group takes training TP ranks
  at stride `k`, a micro-DP group is `k` consecutive TP ranks (times the
  `p / pg` stages merged into one generation stage). A rank's generation
  shard then contains its training shard; it receives the rest from its
  micro-DP group: `(t*p - tg*pg) / (tg*pg * t*p) * M` bytes.
- `vanilla` (HybridFlow-V): consecutive generation TP groups; a rank's
  generation shard generally does not contain its training shard, so the
  replica all-gathers everything: `(t*p - 1) / (t*p) * M`, and the training
  shard is held twice.
- `full` (DeepSpeed-Chat): the whole model onto every rank of the world,
  each of the `d` copies of a piece contributing `1/d` of it:
  `(t*p*d - 1) / (t*p*d) * M`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from hybridflow.models.sharding import ShardSpec, spec_for
from hybridflow.parallel.layout import Coord, ParallelDims  # noqa: F401 (Coord: see gen_coord)
from hybridflow.parallel.stages import layer_index, param_stage

GROUPINGS = ("hybridflow", "vanilla", "full")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter in full (unsharded) form."""

    name: str  # megatron-core global name
    shape: tuple[int, ...]
    element_size: int = 4

    @property
    def spec(self) -> ShardSpec:
        return spec_for(self.name)

    @property
    def nbytes(self) -> int:
        n = self.element_size
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class GenLayout:
    """The generation layout inside each training replica: `pg` stages of `tg`-way TP."""

    tg: int = 1
    pg: int = 1


@dataclass(frozen=True)
class GenCoord:
    """Where a rank sits in the generation layout."""

    tg_rank: int
    pg_stage: int
    micro_dp_rank: int
    # The training replica, CP ranks counted apart (dp * cp + cp rank): each CP rank holds its replica's
    # whole shards, so it serves as one more generation replica (generation DP = replica x micro-DP).
    replica: int


@dataclass(frozen=True)
class Transfer:
    param: str
    piece: tuple[int, int, int]  # (training TP rank, block, slice of the d copies; 0 unless `full`)
    src: int
    dst: int
    nbytes: int


@dataclass
class ReshardPlan:
    train: ParallelDims
    gen: GenLayout
    grouping: str
    gen_coords: list[GenCoord]
    gen_tp_groups: list[tuple[int, ...]]
    micro_dp_groups: list[tuple[int, ...]]
    held: dict[int, set[tuple[str, int, int]]]  # rank -> (param, tp rank, block) after training
    needed: dict[int, set[tuple[str, int, int]]]  # rank -> pieces of its generation shard
    transfers: list[Transfer] = field(default_factory=list)
    needed_bytes: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its generation shard

    def bytes_received(self, rank: int) -> int:
        return sum(t.nbytes for t in self.transfers if t.dst == rank)

    def bytes_sent(self, rank: int) -> int:
        return sum(t.nbytes for t in self.transfers if t.src == rank)

    def generation_replica(self, rank: int) -> tuple[int, int]:
        """(index, count) of the generation data-parallel replica `rank` serves.

        The ranks of one generation TP group (times its `pg` stages) hold one
        generation model and must see the same prompts; there are
        `d * t*p / (tg*pg)` such replicas, numbered training replica first.
        """
        per = self.train.tp * self.train.pp // (self.gen.tg * self.gen.pg)
        g = self.gen_coords[rank]
        return g.replica * per + g.micro_dp_rank, self.train.dp * self.train.cp * per


def _pieces(p: ParamInfo, t: int) -> list[tuple[int, int]]:
    """(TP rank, block) pieces of a parameter; a replicated one is the single piece (-1, 0)."""
    if p.spec.dim is None or t == 1:
        return [(-1, 0)] if p.spec.dim is None else [(0, b) for b in range(p.spec.blocks)]
    return [(r, b) for r in range(t) for b in range(p.spec.blocks)]


def _piece_bytes(p: ParamInfo, t: int) -> int:
    return p.nbytes if p.spec.dim is None else p.nbytes // (t * p.spec.blocks)


def gen_coord(train: ParallelDims, gen: GenLayout, grouping: str, rank: int) -> GenCoord:
    """A rank's generation coordinates under `grouping`."""
    c: Coord = train.coord(rank)
    k, q = train.tp // gen.tg, train.pp // gen.pg
    if grouping == "hybridflow":  # generation TP at stride k; micro-DP = consecutive TP ranks
        tg_rank, tp_micro = c.tp // k, c.tp % k
    else:  # consecutive generation TP groups
        tg_rank, tp_micro = c.tp % gen.tg, c.tp // gen.tg
    return GenCoord(tg_rank=tg_rank, pg_stage=c.pp // q, micro_dp_rank=tp_micro * q + c.pp % q,
                    replica=c.dp * train.cp + c.cp)


def _check(train: ParallelDims, gen: GenLayout, grouping: str, layers: int) -> None:
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    if gen.tg < 1 or train.tp % gen.tg:
        raise ValueError(f"tg={gen.tg} must divide t={train.tp}")
    if gen.pg < 1 or train.pp % gen.pg:
        raise ValueError(f"pg={gen.pg} must divide p={train.pp}")
    if layers % train.pp:
        raise ValueError(f"p={train.pp} must divide the {layers} layers")
    if grouping == "full" and train.cp > 1:
        raise ValueError(f"the 'full' baseline gathers over data-parallel replicas only; got cp = {train.cp}")


def plan_reshard(params: Iterable[ParamInfo], train: ParallelDims, gen: GenLayout,
                 grouping: str = "hybridflow", virtual_pp: int = 1) -> ReshardPlan:
    """Who holds, needs and receives which piece of every parameter (see the module docstring).
    virtual_pp: the training pipeline's model chunks per stage (its layers interleave over the stages)."""
    params = list(params)
    layers = 1 + max((layer_index(p.name) for p in params if layer_index(p.name) is not None), default=0)
    _check(train, gen, grouping, layers)
    if layers % (train.pp * virtual_pp):
        raise ValueError(f"p*virtual_pp = {train.pp}*{virtual_pp} must divide the {layers} layers")
    world, t, k = train.world_size, train.tp, train.tp // gen.tg
    coords = [gen_coord(train, gen, grouping, r) for r in range(world)]
    held: dict[int, set] = {r: set() for r in range(world)}
    needed: dict[int, set] = {r: set() for r in range(world)}
    for p in params:
        stage, gstage = param_stage(p.name, layers, train.pp, virtual_pp), param_stage(p.name, layers, gen.pg)
        for rank in range(world):
            c, g = train.coord(rank), coords[rank]
            for r, b in _pieces(p, t):
                if c.pp == stage and r in (-1, c.tp):
                    held[rank].add((p.name, r, b))
                if grouping == "full" or (g.pg_stage == gstage and (r == -1 or r // k == g.tg_rank)):
                    needed[rank].add((p.name, r, b))
    plan = ReshardPlan(train=train, gen=gen, grouping=grouping, gen_coords=coords,
                       gen_tp_groups=_groups(coords, lambda g: (g.replica, g.pg_stage, g.micro_dp_rank)),
                       micro_dp_groups=_groups(coords, lambda g: (g.replica, g.pg_stage, g.tg_rank)),
                       held=held, needed=needed)
    info = {p.name: p for p in params}
    plan.needed_bytes = {r: sum(_piece_bytes(info[name], t) for name, _, _ in pieces) for r, pieces in needed.items()}
    plan.transfers = [x for rank in range(world) for x in (
        _full_transfers(plan, info, rank) if grouping == "full" else _gather_transfers(plan, info, rank))]
    return plan


def _groups(coords: list[GenCoord], key) -> list[tuple[int, ...]]:
    out: dict = {}
    for rank, g in enumerate(coords):
        out.setdefault(key(g), []).append(rank)
    return [tuple(v) for v in out.values()]


def _gather_transfers(plan: ReshardPlan, info: dict[str, ParamInfo], rank: int) -> list[Transfer]:
    """hybridflow: the pieces it needs, from its micro-DP group; vanilla: every piece of its replica."""
    train = plan.train
    if plan.grouping == "hybridflow":
        peers = next(g for g in plan.micro_dp_groups if rank in g)
        wanted = plan.needed[rank]
    else:
        mine = plan.gen_coords[rank].replica
        peers = tuple(r for r in range(train.world_size) if plan.gen_coords[r].replica == mine)
        wanted = {piece for r in peers for piece in plan.held[r]}
    out = []
    for piece in sorted(wanted - plan.held[rank]):
        src = [r for r in peers if piece in plan.held[r]]
        if not src:
            raise AssertionError(f"no rank of {peers} holds {piece}, which rank {rank} needs")
        out.append(Transfer(piece[0], (piece[1], piece[2], 0), src[0], rank, _piece_bytes(info[piece[0]], train.tp)))
    return out


def _full_transfers(plan: ReshardPlan, info: dict[str, ParamInfo], rank: int) -> list[Transfer]:
    """DeepSpeed-Chat: slice q of every piece comes from its holder in replica q; a rank receives
    every slice it does not own (a replicated piece it holds, it keeps whole)."""
    train, out = plan.train, []
    for name, p in info.items():
        size = _piece_bytes(p, train.tp)
        for r, b in _pieces(p, train.tp):
            piece = (name, r, b)
            if r == -1 and piece in plan.held[rank]:
                continue
            for q in range(train.dp):
                owner = min(h for h in range(train.world_size)
                            if piece in plan.held[h] and train.coord(h).dp == q)
                if owner != rank:
                    out.append(Transfer(name, (r, b, q), owner, rank, _slice_bytes(size, train.dp, q)))
    return out


def _slice_bytes(size: int, d: int, q: int) -> int:
    return size // d + (1 if q < size % d else 0)


def bridge_params(bridge, element_size: int = 4) -> list[ParamInfo]:
    """The parameters a bridge describes, in full Megatron shapes (what `plan_reshard` takes)."""
    return [ParamInfo(name, tuple(shape), element_size) for name, shape in bridge.megatron_shapes().items()]
