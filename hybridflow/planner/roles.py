"""Per-role costs on one rank: what a training role, a forward-only role and the rollout hold and spend.

Built from the plain functions of `cost.py` and the shapes of one iteration (`Workload`, read from the
run's config). Each function returns named parts (`{"weights": bytes, ...}`, `{"compute": s, "tp": s,
...}`) so the search can report the bottleneck resource, not only a total. Roles:

- actor and critic (`train_memory`, `train_time`): weights, fp32 gradients, Adam, activations; the
  update's passes over every row, `ppo_epochs` times, one optimizer step per mini-batch;
- reference, old log-probs, critic values and a reward model (`forward_memory`, `forward_time`): one
  forward pass over every row;
- rollout (`rollout_cost`): prefill once per prompt, then decode steps of a static batch as large as the
  memory left for the KV cache allows (more rows than fit run in waves, as the built-in generator's
  `rollout.batch_size_per_device` chunks do).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from hybridflow.config.schema import Config
from hybridflow.models.config import DecoderConfig
from hybridflow.parallel.layout import ParallelDims
from hybridflow.planner import cost
from hybridflow.planner.devices import DeviceSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Workload:
    """The shapes of one iteration, from the config; lengths are means for time, maxima for memory."""

    prompts: int
    n: int
    prompt_len: float
    response_len: float
    max_len: int
    dtype_bytes: int
    divisible_by: int
    actor_micro: int
    critic_micro: int
    forward_micro: int
    mini_batch_rows: int
    actor_epochs: int
    critic_epochs: int
    needs_reference: bool
    needs_old_log_probs: bool
    uses_critic: bool
    distributed_optimizer: bool
    reward_model: Optional[DecoderConfig] = None
    # Packed micro-batches or shared-prompt rows in a training role: layouts the engine runs at cp = 1 only.
    packed_rows: bool = False
    # trainer.off_policy and its settings: what the run asks for (a rollout apart costs every mode, the
    # iteration ranked is this one's)
    off_policy: str = "sync"
    max_staleness: int = 1
    sync_every: int = 1

    @property
    def rows(self) -> int:
        return self.prompts * self.n

    @property
    def seq(self) -> float:
        return self.prompt_len + self.response_len

    @classmethod
    def from_config(cls, cfg: Config, prompt_len: Optional[float] = None, response_len: Optional[float] = None,
                    reward_model: Optional[DecoderConfig] = None) -> "Workload":
        """Mean lengths default to the maxima (every response runs to `max_response_length`)."""
        from hybridflow.config.plan import needs_old_log_probs
        from hybridflow.config.validate import row_layouts

        d, t = cfg.data, cfg.trainer
        return cls(prompts=d.train_batch_size, n=cfg.rollout.n,
                   prompt_len=float(prompt_len if prompt_len is not None else d.max_prompt_length),
                   response_len=float(response_len if response_len is not None else d.max_response_length),
                   max_len=d.max_prompt_length + d.max_response_length, dtype_bytes=DTYPE_BYTES[cfg.model.dtype],
                   divisible_by=cfg.model.make_vocab_size_divisible_by, actor_micro=cfg.actor.ppo_micro_batch_size,
                   critic_micro=cfg.critic.ppo_micro_batch_size, forward_micro=cfg.actor.log_prob_micro_batch_size,
                   mini_batch_rows=cfg.actor.ppo_mini_batch_size * cfg.rollout.n, actor_epochs=cfg.actor.ppo_epochs,
                   critic_epochs=cfg.critic.ppo_epochs,
                   needs_reference=cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss,
                   needs_old_log_probs=needs_old_log_probs(cfg), uses_critic=cfg.algorithm.adv_estimator == "gae",
                   distributed_optimizer=cfg.actor.parallel.distributed_optimizer, reward_model=reward_model,
                   packed_rows=any(rows.packed or rows.shared for rows in row_layouts(cfg)),
                   off_policy=t.off_policy, max_staleness=t.max_staleness, sync_every=t.sync_every)


def train_memory(model: DecoderConfig, wl: Workload, layout: ParallelDims, micro: int, value_head: bool = False,
                 recompute: bool = False, vpp: int = 1, ep: int = 1) -> dict[str, int]:
    """A training rank's bytes: weights, gradients, optimizer state, activations at the update's peak. At
    `ep` > 1 a rank holds experts / ep of every layer's routed experts, whose optimizer state the distributed
    optimizer shards over the expert-data-parallel ranks (dp * cp / ep), the rest over dp * cp."""
    params = cost.rank_params(model, layout.tp, layout.pp, wl.divisible_by, value_head, ep)
    experts = cost.rank_expert_params(model, layout.tp, layout.pp, ep)
    m = cost.micro_batch_count(wl.mini_batch_rows, layout.dp, micro)
    g = layout.dp * layout.cp
    return {"weights": cost.weight_bytes(params, wl.dtype_bytes), "grads": cost.grad_bytes(params),
            "optimizer": cost.optimizer_bytes(params - experts, wl.dtype_bytes, g, wl.distributed_optimizer)
            + cost.optimizer_bytes(experts, wl.dtype_bytes, max(1, g // ep), wl.distributed_optimizer),
            "activations": cost.activation_bytes(model, layout, micro, wl.max_len, m, wl.dtype_bytes, recompute,
                                                 logits=not value_head, vpp=vpp)}


def _passes(model: DecoderConfig, wl: Workload, layout: ParallelDims, device: DeviceSpec, micro: int, rows: int,
            passes: float, value_head: bool, vpp: int = 1, ep: int = 1) -> dict[str, float]:
    """Seconds of `passes` forward-equivalents over `rows` rows (3 = forward and backward, 4 with the
    recompute's forward), split by resource; activations cross TP twice per layer and pass, and pipeline
    stages once per pass (v times with `vpp` model chunks per rank, whose bubble is v times smaller); at
    cp > 1 each layer exchanges K and V (`cost.cp_time`) and the output is gathered to the whole sequence
    once per micro-batch; the compute slows by the device's `busy_factor` for the ranks of a node computing
    at once (1 on accelerators); at `ep` > 1 every MoE layer's token dispatcher exchanges the tokens of the tp x ep
    group (`cost.dispatch_time`) each pass, forward and (training) backward."""
    tokens = rows * wl.seq
    gemm, attention = cost.forward_flops(model, tokens, wl.seq, value_head)
    m = cost.micro_batch_count(rows, layout.dp, micro)
    bubble = cost.pipeline_factor(layout.pp, m, vpp)
    activation = micro * wl.seq * model.hidden_size * wl.dtype_bytes
    layers = model.num_layers // layout.pp
    calls = m * layers * math.ceil(passes)
    cp = m * layers * cost.cp_time(model, layout, micro, wl.seq, wl.dtype_bytes, device, backward=passes > 1)
    if passes > 3:  # the recompute's forward gathers again
        cp += m * layers * cost.cp_time(model, layout, micro, wl.seq, wl.dtype_bytes, device, backward=False)
    if layout.cp > 1:
        cp += m * cost.gather_time(activation * (layout.cp - 1) / layout.cp, layout.cp, layout.span("cp"), device)
    out: dict[str, float] = {}
    if ep > 1 and model.is_moe:
        one = lambda backward: cost.dispatch_time(model, micro * wl.seq, layout.tp, ep, wl.dtype_bytes, device,
                                                   backward)
        forwards = 2 if passes > 3 else 1  # the recompute's forward dispatches again
        out["dispatch"] = m * layers * (forwards * one(False) + (one(True) if passes > 1 else 0.0))
    # ranks of one node running passes at once share its arithmetic where the device says so (a CPU's cores)
    busy = device.busy_factor(min(layout.world_size, device.devices_per_node))
    compute = passes * cost.compute_time(gemm, attention, layout.world_size, device) * bubble / busy
    return {**out, "cp": cp, "compute": compute,
            "tp": 2 * passes * m * layers * cost.allreduce_time(activation, layout.tp, layout.span("tp"), device),
            "pp": (passes * m * vpp * activation / cost.link_bandwidth(device, layout.span("pp"))
                   if layout.pp > 1 else 0.0),
            "overhead": calls * device.layer_overhead}


def train_time(model: DecoderConfig, wl: Workload, layout: ParallelDims, device: DeviceSpec, micro: int, epochs: int,
               value_head: bool = False, recompute: bool = False, vpp: int = 1, ep: int = 1) -> dict[str, float]:
    """The update of one role: `epochs` passes over every row (forward and backward, one more forward with
    recompute) and the gradient reduction over DP once per mini-batch; `vpp`: model chunks per pipeline
    rank (the interleaved schedule); at `ep` > 1 the routed experts' gradients reduce over the
    expert-data-parallel group (dp * cp / ep ranks), the rest over dp * cp."""
    minis = max(1, math.ceil(wl.rows / wl.mini_batch_rows))
    out = {k: v * epochs for k, v in _passes(model, wl, layout, device, micro, wl.rows,
                                              4.0 if recompute else 3.0, value_head, vpp, ep).items()}
    params = cost.rank_params(model, layout.tp, layout.pp, wl.divisible_by, value_head, ep)
    experts = cost.rank_expert_params(model, layout.tp, layout.pp, ep)
    g = layout.dp * layout.cp  # gradients reduce over the data-and-context group (megatron-core's DDP)
    out["dp"] = epochs * minis * (_reduce(params - experts, g, layout, wl, device)
                                  + _reduce(experts, max(1, g // ep), layout, wl, device))
    return out


def _reduce(params: int, g: int, layout: ParallelDims, wl: Workload, device: DeviceSpec) -> float:
    """The gradient reduction of `params` parameters over `g` ranks once per mini-batch: with the distributed
    optimizer a reduce-scatter of fp32 gradients and an all-gather of the weights, else an all-reduce."""
    if wl.distributed_optimizer:
        share = (g - 1) / g * params * (cost.FP32 + wl.dtype_bytes)
        return cost.gather_time(share, g, layout.span("dp"), device)
    return cost.allreduce_time(params * cost.FP32, g, layout.span("dp"), device)


def forward_memory(model: DecoderConfig, wl: Workload, layout: ParallelDims, micro: int,
                   value_head: bool = False, ep: int = 1) -> dict[str, int]:
    """A forward-only rank: its weights and one layer's activations of a micro-batch plus the logits."""
    params = cost.rank_params(model, layout.tp, layout.pp, wl.divisible_by, value_head, ep)
    one = dataclasses.replace(layout, pp=model.num_layers)  # one layer's activations live at a time
    return {"weights": cost.weight_bytes(params, wl.dtype_bytes),
            "activations": cost.activation_bytes(model, one, micro, wl.max_len, 1, wl.dtype_bytes,
                                                 logits=not value_head)}


def forward_time(model: DecoderConfig, wl: Workload, layout: ParallelDims, device: DeviceSpec, micro: int,
                 value_head: bool = False, vpp: int = 1, ep: int = 1) -> dict[str, float]:
    return _passes(model, wl, layout, device, micro, wl.rows, 1.0, value_head, vpp, ep)


@dataclass(frozen=True)
class RolloutCost:
    time: dict[str, float]
    memory: dict[str, int]
    batch: int  # rows decoded at once per replica
    waves: int


def rollout_cost(model: DecoderConfig, wl: Workload, tg: int, replicas: int, device: DeviceSpec,
                 free_bytes: float, weights: float) -> Optional[RolloutCost]:
    """Generation on each of `replicas` groups of `tg` ranks, the KV cache filling `free_bytes`; None when
    not even one row's cache (and its logits) fits."""
    rows = math.ceil(wl.rows / replicas)
    per_row = cost.kv_cache_bytes(model, wl.max_len, wl.dtype_bytes, tg) + model.vocab_size * cost.FP32
    fit = int(free_bytes // per_row) if free_bytes > 0 else 0
    if fit < 1:
        return None
    batch = min(rows, fit)
    waves = math.ceil(rows / batch)
    prompt_tokens = max(1, batch // wl.n) * wl.prompt_len  # a prompt is prefilled once for its n samples
    gemm, attention = cost.forward_flops(model, int(prompt_tokens), wl.prompt_len / 2)
    activation = prompt_tokens * model.hidden_size * wl.dtype_bytes
    prefill = cost.compute_time(gemm / tg, attention / tg, 1, device) + model.num_layers * device.layer_overhead
    prefill_tp = 2 * model.num_layers * cost.allreduce_time(activation, tg, tg, device)
    ctx = wl.prompt_len + wl.response_len / 2
    step = cost.decode_step_time(model, batch, ctx, weights, tg, device, wl.dtype_bytes)
    step_tp = 2 * model.num_layers * cost.allreduce_time(batch * model.hidden_size * wl.dtype_bytes, tg, tg, device)
    time = {"compute": waves * prefill, "tp": waves * (prefill_tp + wl.response_len * step_tp),
            "decode": waves * wl.response_len * (step - step_tp)}
    memory = {"kv_cache": cost.kv_cache_bytes(model, batch * wl.max_len, wl.dtype_bytes, tg),
              "logits": batch * model.vocab_size * cost.FP32}
    return RolloutCost(time=time, memory=memory, batch=batch, waves=waves)
