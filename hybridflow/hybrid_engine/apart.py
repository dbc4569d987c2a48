"""The weight-sync plan for a rollout group placed apart from training, as plain data.

`plan_apart(params, train, tg, rollout_world)` is a pure function, like the
colocated plan (`plan.py`, whose parameter table, stage rule and piece sizes
it reads): who sends which slice of which parameter to which rollout ranks,
bucketed, with byte counts. `weight_sync.py` runs it with collectives over a
process group spanning both worker groups (tested to move exactly these
bytes); the plan itself is tested without processes.

Ranks. The sync world numbers the `N = p*t*d` training ranks first (their
own ranks), then the `M` rollout ranks (`N + i`). The rollout group generates
at `tg`-way TP in `M / tg` replicas of consecutive ranks: rollout rank `i` is
TP rank `i % tg` of replica `i // tg`, the layout its own worker group's
generator uses.

What a rollout rank needs: its generation shard of every parameter, that is
`shard_tensor(full, spec, i % tg, tg)`, `(M_sharded / tg + M_replicated)`
bytes, whatever the training layout; nothing more (the formula
`needed_bytes`). `tg` need not divide `t` nor the reverse: along the split
dim each of a parameter's `blocks` is cut into `t` training and `tg`
generation ranges, and training rank `r` sends generation rank `j` their
intersection (empty unless they overlap), block by block.

Who sends. A slice of generation TP rank `j`'s shard goes, in one broadcast,
to rank `j` of every rollout replica. Its sender is one of the training
ranks that hold it: the `d` copies of its piece (the stage's training TP
rank whose range overlaps, in each replica; for a replicated tensor, such as
a norm, TP rank `j % t`, which spreads those over the TP ranks and at
t = tg keeps each generation rank on one sender; at expert parallelism `ep`,
an expert's piece only on the `d * c / ep` data- and context-parallel ranks
of its expert-parallel rank, `engine/experts.py`); among them the one with the fewest
bytes assigned so far, slice by slice in plan order, so the training
ranks share the sending evenly (a pure, deterministic choice). Its bytes
are counted once per receiver.

Buckets. A sender's slices for one group are packed into flat buffers of at
most `bucket_bytes` (a larger slice travels alone): one broadcast per bucket.
Every rank runs the plan's broadcasts in plan order, so blocking collectives
over overlapping groups cannot deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from hybridflow.engine.experts import expert_of, expert_rank
from hybridflow.hybrid_engine.plan import ParamInfo
from hybridflow.parallel.layout import Coord, ParallelDims
from hybridflow.parallel.stages import layer_index, param_stage


@dataclass(frozen=True)
class Slice:
    """One parameter's part of a bucket: along `dim`, in each of `blocks` equal blocks, rows
    `[src_start, src_start + length)` of the sender's training shard's block land at
    `[dst_start, dst_start + length)` of the receiver's generation shard's block. `dim` None: the
    whole (replicated) tensor."""

    param: str
    dim: Optional[int]
    blocks: int
    src_start: int
    dst_start: int
    length: int
    nbytes: int


@dataclass(frozen=True)
class Broadcast:
    """One collective: `src` (a training rank) sends the packed `slices` to every rank of `dsts`."""

    src: int
    dsts: tuple[int, ...]  # sync-world ranks (N + rollout rank), ascending
    slices: tuple[Slice, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)

    @property
    def group(self) -> tuple[int, ...]:
        return (self.src, *self.dsts)


@dataclass
class ApartPlan:
    train: ParallelDims
    tg: int
    rollout_world: int
    bucket_bytes: int
    broadcasts: list[Broadcast] = field(default_factory=list)
    needed_bytes: dict[int, int] = field(default_factory=dict)  # rollout rank -> its generation shard's bytes

    @property
    def train_world(self) -> int:
        return self.train.world_size

    @property
    def world(self) -> int:
        return self.train_world + self.rollout_world

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """The distinct broadcast groups, in the order of their first broadcast (the order ranks create them)."""
        return list(dict.fromkeys(b.group for b in self.broadcasts))

    def bytes_received(self, rank: int) -> int:
        """`rank` in the sync world."""
        return sum(b.nbytes for b in self.broadcasts if rank in b.dsts)

    def bytes_sent(self, rank: int) -> int:
        return sum(b.nbytes * len(b.dsts) for b in self.broadcasts if b.src == rank)

    def collectives(self, rank: int) -> int:
        return sum(1 for b in self.broadcasts if rank in b.group)


def _ranges(size: int, parts: int) -> list[tuple[int, int]]:
    step = size // parts
    return [(r * step, (r + 1) * step) for r in range(parts)]


def _slices_of(p: ParamInfo, t: int, tg: int, j: int) -> list[tuple[int, Slice]]:
    """(training TP rank, slice) pairs that make generation TP rank `j`'s shard of `p` (replicated: one)."""
    spec = p.spec
    if spec.dim is None:
        return [(j % t, Slice(p.name, None, 1, 0, 0, 0, p.nbytes))]
    block = p.shape[spec.dim] // spec.blocks
    if block % t or block % tg:
        raise ValueError(f"{p.name}: dim {spec.dim} blocks of {block} do not split into t={t} and tg={tg}")
    row_bytes = p.nbytes // p.shape[spec.dim]  # bytes of one index along the split dim
    g_lo, g_hi = _ranges(block, tg)[j]
    out = []
    for r, (t_lo, t_hi) in enumerate(_ranges(block, t)):
        lo, hi = max(t_lo, g_lo), min(t_hi, g_hi)
        if lo < hi:
            out.append((r, Slice(p.name, spec.dim, spec.blocks, lo - t_lo, lo - g_lo, hi - lo,
                                 (hi - lo) * spec.blocks * row_bytes)))
    return out


def holders_of(train: ParallelDims, tp_rank: int, stage: int, expert: Optional[int] = None, experts: int = 0,
               ep: int = 1) -> list[int]:
    """The training ranks holding TP rank `tp_rank`'s piece of a tensor on `stage`: one per data-parallel
    replica (CP rank 0), or, for expert `expert` at ep > 1, every data- and context-parallel rank of the
    expert-parallel rank that trains it."""
    if expert is None or ep == 1:
        return [train.rank(Coord(tp=tp_rank, cp=0, dp=d, pp=stage)) for d in range(train.dp)]
    owner = expert // (experts // ep)
    return [train.rank(Coord(tp=tp_rank, cp=c, dp=d, pp=stage)) for d in range(train.dp) for c in range(train.cp)
            if expert_rank(d, c, train.cp, ep) == owner]


def add_broadcasts(plan: ApartPlan, by_group: dict[tuple[int, tuple[int, ...]], list[Slice]]) -> None:
    """Each (sender, receivers) group's slices onto `plan` as broadcasts of at most `plan.bucket_bytes` (a
    larger slice travels alone), the groups in sorted order (every rank runs them in plan order)."""
    for (src, dsts), slices in sorted(by_group.items()):
        bucket: list[Slice] = []
        for s in slices:
            if bucket and sum(x.nbytes for x in bucket) + s.nbytes > plan.bucket_bytes:
                plan.broadcasts.append(Broadcast(src, dsts, tuple(bucket)))
                bucket = []
            bucket.append(s)
        if bucket:
            plan.broadcasts.append(Broadcast(src, dsts, tuple(bucket)))


def plan_apart(params: Iterable[ParamInfo], train: ParallelDims, tg: int, rollout_world: int,
               bucket_bytes: int = 64 * 2**20, virtual_pp: int = 1, ep: int = 1) -> ApartPlan:
    """Every broadcast of a sync from the training layout `train` into `rollout_world // tg` replicas of a
    `tg`-way generation model (see the module docstring); virtual_pp: the training stages' model chunks; ep:
    the experts split over that many of a stage's data- and context-parallel ranks."""
    params = list(params)
    experts = 1 + max((expert_of(p.name) for p in params if expert_of(p.name) is not None), default=-1)
    if ep > 1 and (not experts or experts % ep or (train.dp * train.cp) % ep):
        raise ValueError(f"ep={ep} must divide the {experts} experts and the {train.dp * train.cp} dp x cp ranks")
    if tg < 1 or rollout_world % tg:
        raise ValueError(f"tg={tg} must divide the rollout group's {rollout_world} ranks")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    layers = 1 + max((layer_index(p.name) for p in params if layer_index(p.name) is not None), default=0)
    if layers % (train.pp * virtual_pp):
        raise ValueError(f"p*virtual_pp = {train.pp}*{virtual_pp} must divide the {layers} layers")
    n, replicas = train.world_size, rollout_world // tg
    plan = ApartPlan(train, tg, rollout_world, bucket_bytes)
    # (sender, receivers) -> that group's slices, in parameter order
    by_group: dict[tuple[int, tuple[int, ...]], list[Slice]] = {}
    load = {rank: 0 for rank in range(n)}
    for j in range(tg):
        dsts = tuple(n + q * tg + j for q in range(replicas))
        for p in params:
            stage = param_stage(p.name, layers, train.pp, virtual_pp)
            for r, s in _slices_of(p, train.tp, tg, j):
                holders = holders_of(train, r, stage, expert_of(p.name), experts, ep)
                src = min(holders, key=lambda h: (load[h], h))
                load[src] += s.nbytes
                by_group.setdefault((src, dsts), []).append(s)
    add_broadcasts(plan, by_group)
    shard = sum(p.nbytes if p.spec.dim is None else p.nbytes // tg for p in params)
    plan.needed_bytes = {i: shard for i in range(rollout_world)}
    return plan
