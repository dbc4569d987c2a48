"""Splitting RL batches into mini- and micro-batches, one optimizer step on a mini-batch,
and response-token views of model outputs: what the actor, critic and reference share.

A training batch holds INPUT_IDS / ATTENTION_MASK [B, T + R] (prompt then
response) and RESPONSES / RESPONSE_MASK [B, R] plus per-token fields [B, R].
The model output at column `T - 1 + j` predicts response token `j`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.data import fields as F
from hybridflow.data.batch import chunk_by_tokens, chunk_rows, mini_batch_plan, mini_batch_rows, tensor_fields

# A role's loss on one micro-batch: (model output [b, S, ...], micro-batch, the
# global mini-batch denominator) -> (its share of the mini-batch loss, metrics).
LossFn = Callable[[Tensor, dict[str, Tensor], Tensor], tuple[Tensor, dict[str, Any]]]


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm became NaN/inf; names the metric."""

    def __init__(self, metric: str, value: float):
        super().__init__(f"{metric} is {value}")
        self.metric, self.value = metric, value


def check_finite(metric: str, value: float) -> None:
    if not math.isfinite(value):
        raise NonFiniteError(metric, value)


def micro_batches(batch: dict[str, Tensor], size: int, max_tokens: int = 0) -> list[dict[str, Tensor]]:
    """`size` rows each, or with max_tokens > 0 token-budgeted groups (run packed)."""
    return chunk_by_tokens(batch, max_tokens) if max_tokens > 0 else chunk_rows(batch, size)


def update_plan(rows: int, mini_batch_size: int, epochs: int, replicas: int, seed: int) -> list[list[Tensor]]:
    """`data.batch.mini_batch_plan` with its permutations drawn from `seed`."""
    return mini_batch_plan(rows, mini_batch_size, epochs, replicas, torch.Generator().manual_seed(seed))


def one_replica_steps(role, batch: dict[str, Any], step: int) -> list[Tensor]:
    """A role's (`Actor`, `Critic`) steps at `step` when its one replica holds every row of the update;
    refused at dp > 1, where each replica trains on its share (`update_share`)."""
    dp = role.engine.layout.dp
    if dp > 1:
        raise ValueError(f"update() takes every row of the update in one replica; at dp = {dp} give each "
                         "replica its share: update_share(*rows_for_plan(batch, plan(rows, step, dp)[replica]))")
    return role.plan(len(batch[F.INPUT_IDS]), step)[0]


def planned_mini_batches(data: dict[str, Tensor], steps: list[Tensor]) -> Iterator[dict[str, Tensor]]:
    """This replica's share of each global mini-batch, in step order (`data.batch.mini_batch_plan`:
    `steps` index `data`'s rows, -1 a masked padding row)."""
    for index in steps:
        yield mini_batch_rows(data, index)


def forward_only(engine, batch: dict[str, Any], micro_batch_size: int, collect,
                 max_tokens: int = 0, share_prompts: bool = False) -> dict[str, Tensor]:
    """Run `collect(output, micro_batch) -> {field: tensor}` over micro-batches, concatenated.
    max_tokens > 0: token-budgeted micro-batches, each packed into one row (no padding computed).
    share_prompts: a micro-batch's rows with one prompt run as one row, the prompt computed once."""
    micro = micro_batches(tensor_fields(batch), micro_batch_size, max_tokens)
    reports = engine.run(micro, lambda out, mb: (out.new_zeros(()), collect(out, mb)), forward_only=True,
                         packed=max_tokens > 0, share_prompts=share_prompts)
    return {k: torch.cat([r[k] for r in reports]) for k in reports[0]} if reports else {}


def _all_reduce(tensor: Tensor, group, op=None) -> Tensor:
    """`tensor` all-reduced over `group` (summed, or by `op`), returned on the CPU. NCCL takes only CUDA
    tensors, so on a CUDA run's group the tensor travels on the current device and comes back."""
    cuda = dist.get_backend(group) == "nccl"
    moved = tensor.to(torch.device("cuda", torch.cuda.current_device())) if cuda else tensor
    dist.all_reduce(moved, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return moved.cpu() if cuda else moved


def check_reports_finite(reports: list[dict[str, Any]], keys: tuple[str, ...], group=None) -> None:
    """NonFiniteError on every rank when any rank's reports hold a NaN/inf under `keys`.

    Checked after the pass, not inside the loss: at pp > 1 only the last stage
    computes the loss, and a rank raising alone would leave its pipeline and
    data-parallel peers waiting in a collective. The reports are on every
    stage (`MegatronEngine.run`), and the verdict is agreed over `group`.
    """
    bad = [(k, float(r[k])) for r in reports for k in keys if k in r and not math.isfinite(float(r[k]))]
    flag = torch.tensor([1.0 if bad else 0.0], dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        flag = _all_reduce(flag, group, dist.ReduceOp.MAX)
    if flag.item():
        key, value = bad[0] if bad else (keys[0], float("nan"))  # a peer's value: reported as NaN here
        raise NonFiniteError(key, value)


def train_mini_batch(engine, mini: dict[str, Tensor], micro_batch_size: int, loss_agg_mode: str,
                     loss_fn: LossFn, prefix: str, summed: tuple[str, ...] = (),
                     max_tokens: int = 0, share_prompts: bool = False) -> dict[str, float]:
    """One optimizer step whose gradient is that of the global (all DP ranks') mini-batch loss.

    max_tokens > 0 packs token-budgeted micro-batches (`data.batch.chunk_by_tokens`);
    share_prompts runs a micro-batch's rows with one prompt as one row.
    Metrics are those of the global mini-batch (`global_metrics`: averaged over
    its real rows, except the `summed` loss shares, which are checked to be
    finite before the step); `{prefix}/grad_norm` and `{prefix}/lr` come from
    the step.
    """
    group = engine.data_parallel_group
    denom = global_count(mini[F.RESPONSE_MASK], loss_agg_mode, group)
    micro = micro_batches(mini, micro_batch_size, max_tokens)
    # Megatron divides by the number of micro-batches and DDP averages over
    # DP ranks; both are undone so the gradient is that of the global mean
    # (also when token budgets give the ranks different numbers of micro-batches).
    scale = len(micro) * engine.layout.dp

    def step_fn(out: Tensor, mb: dict[str, Tensor]):
        loss, metrics = loss_fn(out, mb, denom)
        metrics[_ROWS] = float(mb[F.RESPONSE_MASK].bool().any(-1).sum())  # 0 for a micro-batch of padding
        return loss * scale, metrics

    engine.zero_grad()
    reports = engine.run(micro, step_fn, packed=max_tokens > 0, share_prompts=share_prompts)
    check_reports_finite(reports, summed, group)
    stats = engine.step()
    check_finite(f"{prefix}/grad_norm", stats.grad_norm)
    out = global_metrics(reports, summed, group)
    out.update({f"{prefix}/grad_norm": stats.grad_norm, f"{prefix}/lr": stats.lr})
    # An MoE model's routers: the actor's as moe/..., another role's as moe/<role>/...
    out.update({f"moe/{k}" if prefix == "actor" else f"moe/{prefix}/{k}": v for k, v in stats.router.items()})
    return out


def response_slice(output: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """Model outputs [B, T+R, ...] -> the R columns that predict the response tokens."""
    r = batch[F.RESPONSES].shape[1]
    s = output.shape[1]
    return output[:, s - r - 1: s - 1]


def global_count(mask: Tensor, mode: str, group=None) -> Tensor:
    """What `aggregate_loss` divides by for the whole (data-parallel) mini-batch."""
    m = mask.bool()
    count = m.sum() if mode == "token-mean" else m.any(-1).sum()
    count = count.to(torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        count = _all_reduce(count, group)
    return count


_ROWS = "_rows"  # a micro-batch report's weight: its real rows


def global_metrics(reports: list[dict[str, Any]], summed: tuple[str, ...], group=None) -> dict[str, float]:
    """The micro-batch reports of every DP rank as the global mini-batch's metrics, in one all-reduce.

    `summed` keys (loss shares of the global mini-batch loss) are summed; keys
    ending in `_max` take the largest value of any micro-batch (a second,
    MAX all-reduce); the others are averaged weighted by each micro-batch's
    real rows, so a micro-batch of padding rows counts nowhere and every
    layout reports what one process does. Every rank gets the same figures.
    """
    keys = sorted({k for r in reports for k, v in r.items() if k != _ROWS and isinstance(v, (int, float))})
    largest = [k for k in keys if k.endswith("_max") and k not in summed]
    out = _largest(reports, largest, group) if largest else {}
    keys = [k for k in keys if k not in out]
    sums = [[sum(float(r[k]) for r in reports if k in r), 1.0] if k in summed else
            [sum(r[_ROWS] * float(r[k]) for r in reports if k in r), sum(r[_ROWS] for r in reports if k in r)]
            for k in keys]
    total = torch.tensor(sums, dtype=torch.float64).view(-1, 2)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        total = _all_reduce(total, group)
    out.update({k: (total[i, 0].item() if k in summed else (total[i, 0] / total[i, 1]).item() if total[i, 1] > 0
                    else 0.0) for i, k in enumerate(keys)})
    return out


def _largest(reports: list[dict[str, Any]], keys: list[str], group=None) -> dict[str, float]:
    """The largest value of each key over the micro-batches of every rank that reported it."""
    most = torch.tensor([max((float(r[k]) for r in reports if k in r and r[_ROWS] > 0), default=-math.inf)
                         for k in keys], dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        most = _all_reduce(most, group, dist.ReduceOp.MAX)
    return {k: most[i].item() for i, k in enumerate(keys)}


def mean_metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Average each float metric over micro-batches."""
    out: dict[str, list[float]] = {}
    for report in reports:
        for k, v in report.items():
            if isinstance(v, (int, float)):
                out.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in out.items()}


def response_log_probs(output: Tensor, batch: dict[str, Tensor], engine,
                       temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """log p(response token) and entropy [B, R] from the engine's (vocab-sharded) logits.

    Megatron pads the vocabulary; padded columns get a huge negative logit so
    the distribution is the unpadded model's (the one generation samples from).
    """
    from hybridflow.kernels import fused_linear_logprob_entropy, logprob_entropy, vocab_parallel_logprob_entropy

    labels = batch[F.RESPONSES]
    vocab, tp = engine.cfg.vocab_size, engine.layout.tp
    if engine.fused_output:  # `output` is hidden states: the output layer runs here, on response tokens only
        real = batch[F.RESPONSE_MASK].bool()
        hidden = response_slice(output, batch)[real]  # [n, H]: padded response columns are skipped too
        if temperature != 1.0:
            hidden = hidden / temperature  # (h / T) W^T = (h W^T) / T
        weight = engine.output_weight[:vocab]  # the padded rows are not part of the distribution
        # Below float32, megatron-core's Float16Module hands the last stage's output back in float32; the
        # hidden states were the weight's dtype before that cast, so casting back loses nothing (and is the
        # product the unfused output layer computes).
        lp, ent = fused_linear_logprob_entropy(hidden.to(weight.dtype), weight, labels[real])
        zeros = torch.zeros(labels.shape, dtype=lp.dtype, device=lp.device)  # 0 where the mask is 0
        return zeros.masked_scatter(real, lp), zeros.masked_scatter(real, ent)
    logits = response_slice(output, batch)
    if temperature != 1.0:
        logits = logits / temperature
    if tp == 1:
        return logprob_entropy(logits[..., :vocab], labels)
    width = logits.shape[-1]
    start = engine.coord.tp * width
    padded = torch.arange(start, start + width, device=logits.device) >= vocab
    if padded.any():
        logits = logits.masked_fill(padded, -1e30)
    return vocab_parallel_logprob_entropy(logits, labels, group=engine.tensor_parallel_group)
