"""The search: every placement and parallel size the trainer can run, costed and ranked.

Placements (HybridFlow's auto-mapping, §6 of the paper, restricted to what hybridflow builds):

- `colocated`: every role on every device, one after another; the actor generates in its `tg` layout
  through the 3D-HybridEngine (the reference shares the actor's processes, the critic may hold its own
  layout in processes of its own on the same devices);
- `split-critic`: the actor (with rollout and reference) on some devices, the critic (and a reward
  model) on the rest; preparation and update of the two groups overlap;
- `split-all`: rollout on devices of its own at tg = 1 (what the trainer builds for a rollout group
  apart: every rollout process holds the whole model, refreshed by a broadcast), actor and critic apart.
  Such a candidate is costed in every `trainer.off_policy` mode (`overlap.py`: lock step, one_step,
  async k), and ranked by the run's own; an off-policy run is planned on split-all alone.

Parallel sizes: training `p-t-d` per role (TP within a node, dividing heads, KV heads and MLP features;
PP dividing the layers), and context parallelism `c` where the engine builds it (padded rows: no packing or
shared prompts; tp x c inside a node), generation `tg` dividing the actor's TP,
replicas = devices / tg. A candidate
is kept only where the config's batch arithmetic splits evenly (mini-batch rows over each DP degree,
prompts over generation replicas), as `config/validate.py` demands. Memory is checked against a usable
fraction of the device (`USABLE`); a candidate that does not fit names the phase, role and GiB over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

from hybridflow.models.config import DecoderConfig
from hybridflow.parallel.layout import ParallelDims
from hybridflow.parallel.stages import layout_label
from hybridflow.planner import cost, overlap, roles
from hybridflow.planner.devices import GIB, DeviceSpec
from hybridflow.planner.roles import Workload

PLACEMENTS = ("colocated", "split-critic", "split-all")
USABLE = 0.92  # of a device's memory: the CUDA context, NCCL buffers and allocator fragmentation take the rest
SECONDS_PER_DAY = 86400


@dataclass
class Candidate:
    placement: str
    devices: dict[str, int]  # group ("actor", "critic", "rollout") -> devices
    actor: ParallelDims
    critic: Optional[ParallelDims]
    tg: int
    replicas: int
    stages: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> resource -> seconds
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> part -> bytes per rank
    device_peak: dict[str, int] = field(default_factory=dict)  # device group -> peak bytes per rank
    iteration_s: float = 0.0
    micro: dict[str, int] = field(default_factory=dict)  # role -> update micro-batch (sequences per device)
    decode_batch: int = 0
    waves: int = 0
    reason: Optional[str] = None  # why it does not fit
    # A rollout apart (split-all): seconds per iteration of each trainer.off_policy mode ("sync", "one_step",
    # "async k=2"; `overlap.py`), the stages they are composed of, and the mode `iteration_s` is (the run's).
    modes: dict[str, float] = field(default_factory=dict)
    split_stages: Optional["overlap.SplitStages"] = None
    mode: str = "sync"
    virtual_pp: int = 1  # the actor's model chunks per pipeline rank (the interleaved schedule), with its reference
    ep: int = 1  # the actor's expert-parallel size (its reference's too); the critic's is `critic_ep`
    critic_ep: int = 1

    @property
    def fits(self) -> bool:
        return self.reason is None

    def prompts_per_day(self, prompts: int) -> float:
        return SECONDS_PER_DAY / self.iteration_s * prompts if self.iteration_s else 0.0

    def bottleneck(self) -> tuple[str, str, float]:
        """(stage, resource, share of the iteration) of the largest single cost on the critical path."""
        stage, resource, seconds = max(((s, r, t) for s, parts in self.stages.items() for r, t in parts.items()),
                                       key=lambda x: x[2])
        return stage, resource, seconds / self.iteration_s if self.iteration_s else 0.0

    def label(self) -> str:
        split = "/".join(f"{k}{v}" for k, v in self.devices.items())
        critic = f" critic {self.critic}" + (f" ep{self.critic_ep}" if self.critic_ep > 1 else "") \
            if self.critic else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return f"{self.placement} [{split}] actor {layout_label(self.actor, self.virtual_pp)}{ep} tg{self.tg}{critic}"


def layouts(world: int, model: DecoderConfig, device: DeviceSpec, wl: Workload) -> list[ParallelDims]:
    """Every p-t-d(-c) of `world` devices the model splits into and the batch arithmetic allows; cp > 1 only
    where the config accepts it (no packed or shared-prompt rows), with tp x cp inside a node (the CP exchange
    runs every layer)."""
    out = []
    for tp in (1, 2, 4, 8, 16):
        if tp > device.devices_per_node or model.num_heads % tp or model.num_kv_heads % tp \
                or any(features % tp for _, features in model.mlp_splits):
            continue
        for pp in (1, 2, 4, 8, 16):
            cps = (1, 2, 4, 8) if not wl.packed_rows else (1,)
            for cp in cps:
                dp = ParallelDims.data_parallel_size(world, tp=tp, pp=pp, cp=cp)
                if model.num_layers % pp or dp is None or tp * cp > device.devices_per_node:
                    continue
                if wl.mini_batch_rows % dp or wl.prompts % dp:
                    continue
                out.append(ParallelDims(tp=tp, pp=pp, dp=dp, cp=cp))
    return out


def _splits(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ways to cut `n` devices into `parts` groups, in units of an eighth of `n` (at least one device)."""
    unit = max(1, n // 8)
    counts = range(unit, n, unit)
    if parts == 2:
        yield from ((a, n - a) for a in counts)
    else:
        yield from ((a, b, n - a - b) for a in counts for b in counts if n - a - b >= unit)


def _total(parts: dict[str, int]) -> int:
    return sum(parts.values())


class Planner:
    """Costs candidates of one job (model, workload, device, device count)."""

    def __init__(self, model: DecoderConfig, wl: Workload, device: DeviceSpec):
        self.model, self.wl, self.device = model, wl, device
        self.usable = device.memory_bytes * USABLE
        self.model_bytes = cost.total_params(model, wl.divisible_by) * wl.dtype_bytes

    # -- the roles of one candidate ----------------------------------------------------------------
    def _states(self, layout: ParallelDims, value_head: bool, ep: int = 1) -> int:
        """Weights, gradients and optimizer state of a training rank (what does not depend on the batch)."""
        parts = roles.train_memory(self.model, self.wl, layout, 1, value_head, ep=ep)
        return _total(parts) - parts["activations"]

    def static_actor(self, a: ParallelDims, ep: int = 1) -> int:
        ref = cost.rank_params(self.model, a.tp, a.pp, self.wl.divisible_by, ep=ep) * self.wl.dtype_bytes
        return self._states(a, False, ep) + (ref if self.wl.needs_reference else 0)

    def static_critic(self, k: Optional[ParallelDims], reward_layout: ParallelDims, ep: int = 1) -> int:
        out = self._states(k, True, ep) if self.wl.uses_critic else 0
        rm = self.wl.reward_model
        if rm is not None:
            out += cost.rank_params(rm, reward_layout.tp, reward_layout.pp, self.wl.divisible_by, True) \
                * self.wl.dtype_bytes
        return out

    def _micro(self, layout: ParallelDims, budget: float, start: int, value_head: bool, vpp: int = 1) -> int:
        """The largest micro-batch (halving from the config's) whose update activations fit `budget`."""
        micro = start
        while micro > 1:
            m = cost.micro_batch_count(self.wl.mini_batch_rows, layout.dp, micro)
            if cost.activation_bytes(self.model, layout, micro, self.wl.max_len, m, self.wl.dtype_bytes,
                                     logits=not value_head, vpp=vpp) <= budget:
                break
            micro //= 2
        return micro

    def _actor_side(self, c: Candidate, budget: float) -> tuple[int, dict[str, int], dict[str, float]]:
        """Static bytes of the actor's ranks, their transient peaks by phase, and their stage times;
        `budget`: bytes the actor's ranks may fill (the micro-batch is halved until its activations fit)."""
        m, wl, a, dev, v, ep = self.model, self.wl, c.actor, self.device, c.virtual_pp, c.ep
        static = self.static_actor(a, ep)
        c.micro["actor"] = micro = self._micro(a, budget - static, wl.actor_micro, False, v)
        c.memory["actor"] = roles.train_memory(m, wl, a, micro, vpp=v, ep=ep)
        phases = {"actor update": c.memory["actor"]["activations"]}
        times = {"actor_update": roles.train_time(m, wl, a, dev, micro, wl.actor_epochs, vpp=v, ep=ep)}
        forward = roles.forward_memory(m, wl, a, wl.forward_micro, ep=ep)
        if wl.needs_reference:
            c.memory["reference"] = forward
            times["reference"] = roles.forward_time(m, wl, a, dev, wl.forward_micro, vpp=v, ep=ep)
        if wl.needs_old_log_probs:
            times["old_log_probs"] = roles.forward_time(m, wl, a, dev, wl.forward_micro, vpp=v, ep=ep)
        if wl.needs_reference or wl.needs_old_log_probs:
            phases["log-prob passes"] = forward["activations"]
        return static, phases, times

    def _critic_side(self, c: Candidate, budget: float) -> tuple[int, dict[str, int], dict[str, float]]:
        m, wl, dev = self.model, self.wl, self.device
        layout, ep = c.critic or c.actor, c.critic_ep
        static, phases, times = self.static_critic(c.critic, layout, ep), {}, {}
        if wl.uses_critic:
            k = c.critic
            c.micro["critic"] = micro = self._micro(k, budget - static, wl.critic_micro, True)
            c.memory["critic"] = roles.train_memory(m, wl, k, micro, value_head=True, ep=ep)
            phases["critic update"] = c.memory["critic"]["activations"]
            times["critic_update"] = roles.train_time(m, wl, k, dev, micro, wl.critic_epochs, True, ep=ep)
            times["values"] = roles.forward_time(m, wl, k, dev, wl.forward_micro, value_head=True, ep=ep)
        if wl.reward_model is not None:
            c.memory["reward_model"] = roles.forward_memory(wl.reward_model, wl, layout, wl.forward_micro, True)
            phases["reward model"] = c.memory["reward_model"]["activations"]
            times["reward_model"] = roles.forward_time(wl.reward_model, wl, layout, dev, wl.forward_micro, True)
        return static, phases, times

    def _rollout(self, c: Candidate, free: float, weights: float) -> Optional[dict[str, float]]:
        r = roles.rollout_cost(self.model, self.wl, c.tg, c.replicas, self.device, free, weights)
        if r is None:
            per_row = cost.kv_cache_bytes(self.model, self.wl.max_len, self.wl.dtype_bytes, c.tg)
            c.reason = (f"rollout: generation weights ({weights / GIB:.1f} GiB) and one sequence's KV cache do not "
                        f"fit beside the other roles' states ({(per_row - free) / GIB:.1f} GiB over)")
            return None
        c.memory["rollout"] = {"weights": int(weights), **r.memory}
        c.decode_batch, c.waves = r.batch, r.waves
        return r.time

    def _check(self, c: Candidate, group: str, static: int, phases: dict[str, int],
               held: tuple[str, ...] = ("actor", "reference", "critic", "reward_model")) -> bool:
        """Record the group's peak; set the reason (phase, GiB over, the states of the roles `held` on the
        group's devices) when it exceeds the usable memory."""
        name, transient = max(phases.items(), key=lambda kv: kv[1]) if phases else ("weights", 0)
        c.device_peak[group] = static + transient
        if static + transient > self.usable and c.reason is None:
            over = (static + transient - self.usable) / GIB
            states = ", ".join(f"{role} {(sum(p.values()) - p.get('activations', 0)) / GIB:.1f}"
                               for role, p in c.memory.items() if role in held)
            c.reason = (f"{group} devices, {name}: {over:.2f} GiB over (of {self.usable / GIB:.0f} GiB usable; "
                        f"states {static / GIB:.1f} GiB [{states}] + {name} {transient / GIB:.1f} GiB)")
        return c.reason is None

    # -- placements --------------------------------------------------------------------------------
    def colocated(self, n: int, actor: ParallelDims, critic: Optional[ParallelDims], tg: int,
                  virtual_pp: int = 1, ep: int = 1) -> Candidate:
        c = Candidate("colocated", {"all": n}, actor, critic, tg, n // tg, virtual_pp=virtual_pp, ep=ep,
                      critic_ep=critic_ep(critic, actor, ep))
        a_own = self.static_actor(actor, ep)
        k_own = self.static_critic(critic, critic or actor, c.critic_ep)
        a_static, a_phases, a_times = self._actor_side(c, self.usable - k_own)
        k_static, k_phases, k_times = self._critic_side(c, self.usable - a_own)
        static = a_static + k_static
        gen_weights = self.model_bytes / tg
        # the generation shard holds the training shard; at ep > 1 and tp > 1 the other ranks' experts' TP
        # shards, gathered first, are held beside it (docs/design.md, "Expert parallelism and its bytes")
        extra = gen_weights - c.memory["actor"]["weights"] + self.expert_buffers(actor, ep)
        phases = {**a_phases, **k_phases}
        if not self._check(c, "all", static, phases):
            return c
        times = self._rollout(c, self.usable - static - extra, gen_weights)
        if times is None:
            return c
        c.device_peak["all"] = max(c.device_peak["all"], static + int(extra) + _total(c.memory["rollout"])
                                   - c.memory["rollout"]["weights"])
        c.stages = {"rollout": times, "transition": self.transition(actor, tg, ep), **a_times, **k_times}
        c.iteration_s = sum(_total_s(t) for t in c.stages.values())
        return c

    def expert_buffers(self, actor: ParallelDims, ep: int) -> float:
        """Bytes an expert-parallel rank holds besides its generation weights at tp > 1: the other ranks'
        experts' TP shards, gathered before the grouped gather (at tp = 1 they are the generation weights)."""
        if actor.tp <= 1:
            return 0.0
        return cost.expert_transition_bytes(self.model, actor.tp, ep, self.wl.dtype_bytes, actor.pp)

    def transition(self, actor: ParallelDims, tg: int, ep: int = 1) -> dict[str, float]:
        """Seconds of the switch to generation: at ep > 1 the all-gather of the other expert-parallel ranks'
        experts ((ep - 1) / ep * X / tp per rank, over the tp x ep ranks that group spans), then the dense
        grouped gather of the paper's layout over the whole model."""
        moved = cost.transition_bytes(self.model_bytes, actor.tp, actor.pp, tg)
        out = {"link": cost.gather_time(moved, actor.tp * actor.pp // tg, actor.tp, self.device)}
        if ep > 1:
            experts = cost.expert_transition_bytes(self.model, actor.tp, ep, self.wl.dtype_bytes, actor.pp)
            out["experts"] = cost.gather_time(experts, ep, actor.tp * actor.cp * ep, self.device)
        return out

    def split(self, placement: str, devices: dict[str, int], actor: ParallelDims, critic: Optional[ParallelDims],
              tg: int, virtual_pp: int = 1, ep: int = 1) -> Candidate:
        """split-critic (rollout with the actor) or split-all (rollout on `devices['rollout']` at tg = 1)."""
        apart = placement == "split-all"
        replicas = devices["rollout"] if apart else devices["actor"] // tg
        c = Candidate(placement, devices, actor, critic, tg, replicas, virtual_pp=virtual_pp, ep=ep,
                      critic_ep=critic_ep(critic, actor, ep))
        a_static, a_phases, a_times = self._actor_side(c, self.usable)
        k_static, k_phases, k_times = self._critic_side(c, self.usable)
        if not self._check(c, "actor", a_static, a_phases, ("actor", "reference")):
            return c
        if (critic is not None or self.wl.reward_model is not None) and not self._check(
                c, "critic", k_static, k_phases, ("critic", "reward_model")):
            return c
        if apart:
            free = self.usable - self.model_bytes
            times = self._rollout(c, free, self.model_bytes)
            sync = {"link": self.model_bytes / cost.link_bandwidth(self.device, sum(devices.values()))}
        else:
            extra = self.model_bytes / tg - c.memory["actor"]["weights"] + self.expert_buffers(actor, c.ep)
            times = self._rollout(c, self.usable - a_static - extra, self.model_bytes / tg)
            sync = self.transition(actor, tg, c.ep)
        if times is None:
            return c
        prep_a = {k: v for k, v in a_times.items() if k != "actor_update"}
        prep_k = {k: v for k, v in k_times.items() if k != "critic_update"}
        c.stages = {"rollout": times, "transition": sync,
                    "preparation": _slower(prep_a, prep_k), "update": _slower(
                        {"actor_update": a_times["actor_update"]},
                        {"critic_update": k_times["critic_update"]} if "critic_update" in k_times else {})}
        c.iteration_s = sum(_total_s(t) for t in c.stages.values())
        if apart:
            c.split_stages = self.split_stages(c)
            k, e = self.async_settings()
            c.modes = {overlap.mode_label(mode, k): overlap.iteration_seconds(mode, c.split_stages, k, e)
                       for mode in overlap.MODES}
            c.mode = overlap.mode_label(self.wl.off_policy, k)
            c.iteration_s = c.modes[c.mode]
        return c

    def async_settings(self) -> tuple[int, int]:
        """(max_staleness, sync_every) the async column is costed at: the config's when it runs async, else
        k = 2 pushed every update (what `bench async` measures)."""
        return (self.wl.max_staleness, self.wl.sync_every) if self.wl.off_policy == "async" else (2, 1)

    def split_stages(self, c: Candidate) -> overlap.SplitStages:
        """A candidate with its rollout apart as `overlap.SplitStages`: its rollout, sync, preparation and
        update, and what the off-policy modes add: the staged copy of the actor's shard. (They run the old
        log-prob pass exactly where lock step does, `config.plan.needs_old_log_probs`: it is in the
        preparation.)"""
        wl, a = self.wl, c.actor
        shard = cost.rank_params(self.model, a.tp, a.pp, wl.divisible_by) * wl.dtype_bytes
        return overlap.SplitStages(
            rollout=_total_s(c.stages["rollout"]), sync=_total_s(c.stages["transition"]),
            prep=_total_s(c.stages["preparation"]), update=_total_s(c.stages["update"]),
            stage=2 * shard / (self.device.memory_bw * self.device.efficiency["decode"]))  # read and write a clone

    # -- the search --------------------------------------------------------------------------------
    def candidates(self, n: int, placements: tuple[str, ...] = PLACEMENTS) -> list[Candidate]:
        wl, m, dev = self.wl, self.model, self.device
        out = []
        if wl.off_policy != "sync":  # only a rollout apart runs off-policy (config/validate.py refuses the rest)
            placements = tuple(p for p in placements if p == "split-all")
        if "colocated" in placements:
            for a in layouts(n, m, dev, wl):
                for k in (layouts(n, m, dev, wl) if wl.uses_critic else [None]):
                    out += [self.colocated(n, a, k, tg, v, ep) for ep in expert_parallel_sizes(m, a, "colocated")
                            for tg in _tgs(a, wl, n) for v in _vpps(a, m, wl)]
        if "split-critic" in placements and (wl.uses_critic or wl.reward_model is not None) and n > 1:
            for na, nc in _splits(n, 2):
                for a in layouts(na, m, dev, wl):
                    for k in layouts(nc, m, dev, wl):
                        out += [self.split("split-critic", {"actor": na, "critic": nc}, a, k, tg, v, ep)
                                for ep in expert_parallel_sizes(m, a, "split-critic")
                                for tg in _tgs(a, wl, na) for v in _vpps(a, m, wl)]
        if "split-all" in placements and n > 1:
            cuts = _splits(n, 3) if wl.uses_critic else ((r, n - r, 0) for r, _ in _splits(n, 2))
            for nr, na, nc in cuts:
                if wl.prompts % nr:
                    continue
                for a in layouts(na, m, dev, wl):
                    for k in (layouts(nc, m, dev, wl) if nc else [None]):
                        devices = {"rollout": nr, "actor": na, **({"critic": nc} if nc else {})}
                        out += [self.split("split-all", devices, a, k, 1, v, ep) for v in _vpps(a, m, wl)
                                for ep in expert_parallel_sizes(m, a, "split-all")]
        return out


def expert_parallel_sizes(model: DecoderConfig, layout: ParallelDims, placement: str) -> list[int]:
    """The actor's expert-parallel sizes a candidate is costed at: 1, and for an MoE model every ep dividing
    both its experts and the data- x context-parallel ranks of a stage (megatron-core carves the expert-parallel
    groups from them: expert-data-parallel = dp * cp / ep at etp = tp), the rules `config/validate_moe.py`
    checks, at any pp and placement."""
    if not model.is_moe:
        return [1]
    ranks = layout.dp * layout.cp
    return [ep for ep in range(1, ranks + 1) if ranks % ep == 0 and model.num_experts % ep == 0]


def critic_ep(critic: Optional[ParallelDims], actor: ParallelDims, ep: int) -> int:
    """The critic's expert-parallel size beside an actor at `ep`: the actor's where its layout takes it (at the
    actor's own layout it shares the actor's processes, hence its megatron-core layout), else 1."""
    if critic is None or ep == 1:
        return 1
    if critic == actor or (critic.dp * critic.cp) % ep == 0:
        return ep
    return 1


def _vpps(actor: ParallelDims, model: DecoderConfig, wl: Workload) -> list[int]:
    """The actor's model chunks per pipeline rank: 1, and 2 or 4 (the interleaved schedule) where pp > 1
    and the layers split into pp x v chunks (at any cp, and with the rollout apart too). Not with a critic:
    without Ray it must share the actor's megatron-core layout, which the search does not pair."""
    if actor.pp < 2 or wl.uses_critic:
        return [1]
    return [1] + [v for v in (2, 4) if model.num_layers % (actor.pp * v) == 0]


def _tgs(actor: ParallelDims, wl: Workload, n: int) -> list[int]:
    """Generation TP sizes: divisors of the actor's TP whose replicas split the prompts evenly."""
    return [tg for tg in (1, 2, 4, 8, 16) if actor.tp % tg == 0 and wl.prompts % (n // tg) == 0]


def _total_s(parts: dict[str, float]) -> float:
    return sum(parts.values())


def _slower(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, float]:
    """The resources of whichever of two overlapping groups of stages takes longer (its stages summed)."""
    def merged(stages: dict[str, dict[str, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, parts in stages.items():
            for resource, seconds in parts.items():
                out[f"{name}.{resource}"] = out.get(f"{name}.{resource}", 0.0) + seconds
        return out
    ma, mb = merged(a), merged(b)
    return ma if _total_s(ma) >= _total_s(mb) else mb


def rank(candidates: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(fitting candidates fastest first, the others) ."""
    fits = sorted((c for c in candidates if c.fits), key=lambda c: c.iteration_s)
    return fits, [c for c in candidates if not c.fits]


def gpus_needed(planner: Planner, start: int, prompts_per_day: float, limit: int = 1024) -> Optional[Candidate]:
    """The best candidate on the fewest devices (in whole nodes from `start`) reaching `prompts_per_day`."""
    step = planner.device.devices_per_node
    n = max(step, math.ceil(start / step) * step)
    while n <= limit:
        fits, _ = rank(planner.candidates(n))
        if fits and fits[0].prompts_per_day(planner.wl.prompts) >= prompts_per_day:
            return fits[0]
        n += step
    return None
