"""The cost model: memory, time and communication of one role on one rank, as plain functions.

Every function takes the model's shapes (`DecoderConfig`), the work's shapes, a layout (`ParallelDims`) and a
`DeviceSpec`, and returns bytes or seconds. Nothing here measures; `search.py` composes these into an
iteration and `calibrate.py` fits the device's efficiency factors to a measured run. What is modelled,
and what is not:

- Parameters are counted exactly for the megatron-core layout hybridflow trains (`rank_params`): padded
  vocabulary, grouped QKV (with Qwen2's bias), `[gate; up]`, replicated norms, embedding on the first
  pipeline stage, final norm and output layer (or the critic's scalar value head) on the last.
- Training state follows the engine (`engine/megatron.py`): gradients in an fp32 buffer
  (`grad_reduce_in_fp32`), Adam's two moments in fp32 plus an fp32 master copy when the weights are
  16-bit (12 bytes per parameter), sharded over data-parallel ranks by the distributed optimizer.
- Activations per layer and token follow the local layer spec (no Transformer Engine, no sequence
  parallelism): the stored inputs of both norms and matmuls, Q/K/V, the SwiGLU halves and the unfused
  attention's softmax (`heads * seq` per token). Full recomputation keeps one layer input per token.
  1F1B keeps `min(p, micro-batches)` micro-batches in flight on the first stage.
- Context parallelism (`layout.cp`, the engine's `CpDotProductAttention`): each CP rank keeps the layers'
  activations of its S/cp tokens, each token's attention probabilities still spanning all S keys, plus
  the all-gathered keys and values of the whole sequence per layer (`cp_kv_bytes`); the model's output is
  gathered to the whole sequence on every CP rank before the loss, so the logits are not divided by cp.
  Per layer and micro-batch the forward all-gathers K and V and the backward reduce-scatters their
  gradients over the CP group (`cp_time`); the gradients reduce over dp x cp ranks, and the distributed
  optimizer shards over them.
- Time is FLOPs over peak times an efficiency per kind of work (GEMM, attention), a decode step is the
  slower of its FLOPs and its bytes (weights and KV cache) over memory bandwidth, plus a per-layer launch
  overhead; collectives are ring all-reduces (`2 (g-1)/g` of the bytes) over the link the group spans.
"""
from __future__ import annotations

import math

from hybridflow.models.config import DecoderConfig
from hybridflow.models.sharding import padded_vocab_size
from hybridflow.parallel.layout import ParallelDims
from hybridflow.planner.devices import DeviceSpec

FP32 = 4


# --------------------------------------------------------------------------- parameters

def mlp_params(cfg: DecoderConfig, active: bool = False) -> int:
    """Matrix parameters of one layer's MLP: the dense SwiGLU, or every expert (active: the top-k a token
    runs) and the shared expert; the router and the shared expert's gate apart."""
    h = cfg.hidden_size
    if not cfg.is_moe:
        return 3 * cfg.intermediate_size * h
    experts = cfg.moe_top_k if active else cfg.num_experts
    return 3 * h * (experts * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)


def expert_params(cfg: DecoderConfig) -> int:
    """Matrix parameters of one layer's routed experts (0 for a dense model): what expert parallelism
    splits; the shared expert and the router stay with the dense parameters."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts if cfg.is_moe else 0


def layer_params(cfg: DecoderConfig, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one decoder layer on one of `tp` ranks (norms, QK-norms, the router and the shared
    expert's gate replicated, the rest split); the routed experts split like an MLP over `tp` and, whole,
    over the `ep` ranks of an expert-parallel group (megatron-core: experts / ep per rank, etp = tp)."""
    h, hq = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    experts = expert_params(cfg)
    split = cfg.qkv_size * h + (cfg.qkv_size if cfg.qkv_bias else 0) + hq * h + mlp_params(cfg) - experts
    replicated = 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0) + cfg.num_experts * h \
        + (h if cfg.shared_expert_gate else 0)
    return split // tp + experts // (tp * ep) + replicated


def rank_expert_params(cfg: DecoderConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> int:
    """Routed-expert parameters one rank holds: its stage's layers' experts / (tp * ep). Their gradients
    reduce, and the distributed optimizer shards them, over the expert-data-parallel group (dp * cp / ep
    ranks at etp = tp) instead of the dp * cp ranks of the dense parameters."""
    return expert_params(cfg) // (tp * ep) * (cfg.num_layers // pp)


def stage_params(cfg: DecoderConfig, stage: int, tp: int = 1, pp: int = 1, divisible_by: int = 128,
                 value_head: bool = False, ep: int = 1) -> int:
    """Parameters pipeline stage `stage` of `pp` holds on each of its `tp` ranks (megatron-core's layout),
    the routed experts divided over `ep`.

    value_head: the critic, whose output layer is one replicated row. Tied embeddings with pp > 1 keep a
    copy of the embedding on the last stage, as megatron-core does.
    """
    h = cfg.hidden_size
    vocab = padded_vocab_size(cfg.vocab_size, divisible_by, tp) * h // tp
    n = layer_params(cfg, tp, ep) * (cfg.num_layers // pp)
    last = stage == pp - 1
    if stage == 0:
        n += vocab
    if last:
        n += h  # final norm
        if value_head:
            n += h
        elif not cfg.tie_word_embeddings or pp > 1:
            n += vocab
    return n


def rank_params(cfg: DecoderConfig, tp: int = 1, pp: int = 1, divisible_by: int = 128,
                value_head: bool = False, ep: int = 1) -> int:
    """The most parameters any rank holds (the stage that bounds memory)."""
    return max(stage_params(cfg, s, tp, pp, divisible_by, value_head, ep) for s in range(pp))


def total_params(cfg: DecoderConfig, divisible_by: int = 128, value_head: bool = False) -> int:
    """Parameters of the whole model, vocabulary padded as megatron-core pads it at TP 1."""
    return stage_params(cfg, 0, 1, 1, divisible_by, value_head)


def matmul_params(cfg: DecoderConfig, value_head: bool = False) -> int:
    """Parameters that take part in a matrix product per token (all but the embedding lookup and norms): for
    a mixture of experts, its active parameters (the router, the top-k experts, the shared expert)."""
    h, hq = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    per_layer = cfg.qkv_size * h + hq * h + mlp_params(cfg, active=True) + cfg.num_experts * h \
        + (h if cfg.shared_expert_gate else 0)
    return cfg.num_layers * per_layer + (h if value_head else cfg.vocab_size * h)


# --------------------------------------------------------------------------- memory (bytes per rank)

def weight_bytes(params: int, dtype_bytes: int) -> int:
    return params * dtype_bytes


def grad_bytes(params: int) -> int:
    """The engine's gradient buffer is fp32 whatever the weights' dtype (grad_reduce_in_fp32)."""
    return params * FP32


def optimizer_bytes(params: int, dtype_bytes: int, dp: int = 1, distributed: bool = True) -> int:
    """Adam: two fp32 moments, plus an fp32 master copy of 16-bit weights (12 or 8 bytes per parameter),
    split over the `dp` ranks by the distributed optimizer (at cp > 1 pass dp * cp: it shards over both)."""
    per = 3 * FP32 if dtype_bytes < FP32 else 2 * FP32
    shards = dp if distributed else 1
    return -(-params * per // shards)


def activation_bytes_per_token(cfg: DecoderConfig, seq: int, tp: int, dtype_bytes: int,
                               recompute: bool = False) -> float:
    """Bytes one layer keeps per token of a micro-batch for its backward pass, on one of `tp` ranks."""
    if recompute:
        return cfg.hidden_size * dtype_bytes
    h, hq = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    ffn = mlp_params(cfg, active=True) // (3 * h)  # the features a token's MLP computes (its experts')
    stored = 4 * h + (cfg.qkv_size + hq) / tp + 3 * ffn / tp  # norm and matmul inputs, QKV, gate/up, SwiGLU out
    softmax = cfg.num_heads / tp * seq  # unfused attention keeps its probabilities
    return (stored + softmax) * dtype_bytes


def cp_kv_bytes(cfg: DecoderConfig, micro: int, seq: int, tp: int, cp: int, dtype_bytes: int) -> float:
    """One layer's all-gathered keys and values at cp > 1, kept for its backward: the whole sequence's
    2 * kv_heads * head_dim per token (0 at cp = 1, where each token's own K and V are in the layer's QKV)."""
    if cp <= 1:
        return 0.0
    return 2 * cfg.num_kv_heads * cfg.head_dim / tp * micro * seq * dtype_bytes


def activation_bytes(cfg: DecoderConfig, layout: ParallelDims, micro: int, seq: int, micro_batches: int,
                     dtype_bytes: int, recompute: bool = False, logits: bool = True, vpp: int = 1) -> int:
    """Activations a training rank holds at its peak: the first stage's layers for the micro-batches
    1F1B (or the interleaved schedule, `vpp` > 1) keeps in flight (`chunks_in_flight`), one layer's full
    set while recomputing, and the last stage's fp32 logits. At cp > 1 a rank holds its S/cp tokens of
    each layer, the gathered K and V, and the whole logits."""
    tokens = micro * seq / layout.cp
    layers = cfg.num_layers // layout.pp
    in_flight = chunks_in_flight(layout.pp, micro_batches, vpp)
    kept = layers * in_flight * tokens * activation_bytes_per_token(cfg, seq, layout.tp, dtype_bytes, recompute)
    gathered = cp_kv_bytes(cfg, micro, seq, layout.tp, layout.cp, dtype_bytes)
    if recompute:
        kept += tokens * activation_bytes_per_token(cfg, seq, layout.tp, dtype_bytes) + gathered
    else:
        kept += layers * in_flight * gathered
    vocab = padded_vocab_size(cfg.vocab_size, 128, layout.tp) // layout.tp if logits else 1
    return int(kept + micro * seq * vocab * FP32)


def kv_cache_bytes(cfg: DecoderConfig, tokens: int, dtype_bytes: int, tg: int = 1, pg: int = 1) -> int:
    """Keys and values of `tokens` positions, on one of `tg * pg` generation ranks:
    2 * layers * kv_heads * head_dim * tokens * bytes / (tg * pg)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * tokens * dtype_bytes // (tg * pg)


# --------------------------------------------------------------------------- compute

def forward_flops(cfg: DecoderConfig, tokens: int, ctx: float, value_head: bool = False) -> tuple[float, float]:
    """(GEMM, attention) FLOPs of a forward pass over `tokens` positions that each attend to `ctx` keys."""
    gemm = 2.0 * matmul_params(cfg, value_head) * tokens
    attention = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx * tokens
    return gemm, attention


def compute_time(gemm: float, attention: float, ranks: int, device: DeviceSpec) -> float:
    """Seconds for FLOPs shared evenly by `ranks` devices, at the device's GEMM and attention efficiency."""
    peak = device.peak_flops * ranks
    return gemm / (peak * device.efficiency["gemm"]) + attention / (peak * device.efficiency["attention"])


def decode_step_time(cfg: DecoderConfig, batch: int, ctx: float, weights: float, tg: int,
                     device: DeviceSpec, dtype_bytes: int) -> float:
    """One decode step of `batch` rows at context `ctx` on one of `tg` ranks: reading its weights share and
    the KV cache, or its FLOPs, whichever is slower, plus the layers' launch overhead and TP all-reduces."""
    read = weights + kv_cache_bytes(cfg, int(batch * ctx), dtype_bytes, tg)
    memory = read / (device.memory_bw * device.efficiency["decode"])
    gemm, attention = forward_flops(cfg, batch, ctx)
    flops = compute_time(gemm / tg, attention / tg, 1, device)
    tp = 2 * cfg.num_layers * allreduce_time(batch * cfg.hidden_size * dtype_bytes, tg, tg, device)
    return max(memory, flops) + cfg.num_layers * device.layer_overhead + tp


# --------------------------------------------------------------------------- communication

def link_bandwidth(device: DeviceSpec, span: int) -> float:
    """Bytes/s between the ranks of a group whose members lie within `span` consecutive devices."""
    fast = span <= device.devices_per_node
    return (device.intra_bw if fast else device.inter_bw) * device.efficiency["comm"]


def allreduce_time(nbytes: float, group: int, span: int, device: DeviceSpec) -> float:
    """A ring all-reduce of `nbytes` over `group` ranks spanning `span` devices: 2 (g-1)/g of the bytes."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * nbytes / link_bandwidth(device, span) + 2 * (group - 1) * device.link_latency


def gather_time(nbytes_received: float, group: int, span: int, device: DeviceSpec) -> float:
    """An all-gather (or a reduce-scatter) in which each rank receives `nbytes_received`."""
    if group <= 1 or nbytes_received <= 0:
        return 0.0
    return nbytes_received / link_bandwidth(device, span) + (group - 1) * device.link_latency


def cp_time(cfg: DecoderConfig, layout: ParallelDims, micro: int, seq: float, dtype_bytes: int,
            device: DeviceSpec, backward: bool = True) -> float:
    """One layer's CP exchange for one micro-batch: the all-gather of K and V (each rank receives the
    other ranks' (cp-1)/cp of them), and with `backward` the reduce-scatter of their gradients."""
    if layout.cp <= 1:
        return 0.0
    received = cp_kv_bytes(cfg, micro, int(seq), layout.tp, layout.cp, dtype_bytes) * (layout.cp - 1) / layout.cp
    one = gather_time(received, layout.cp, layout.span("cp"), device)
    return one * (2 if backward else 1)


def dispatch_bytes_per_token(cfg: DecoderConfig, ep: int, dtype_bytes: int, backward: bool = False) -> float:
    """Bytes one rank receives per token of its micro-batch and per MoE layer in megatron-core's allgather
    token dispatcher (the one the engine builds, `engine/build.py`), beyond what a dense layer's TP exchange
    moves: the dispatch gathers every token of the tp x ep group (its hidden state, its fp32 router
    probabilities and the boolean routing map over the experts), the combine reduce-scatters the outputs back,
    so each rank receives the other ep - 1 ranks' tokens twice. The backward reverses both (gradients of the
    hidden states and the probabilities, no map). 0 at ep = 1 or for a dense model."""
    if not cfg.is_moe or ep <= 1:
        return 0.0
    probs = cfg.num_experts * (FP32 + (0 if backward else 1))
    return (ep - 1) * (2 * cfg.hidden_size * dtype_bytes + probs)


def alltoall_bytes_per_token(cfg: DecoderConfig, ep: int, dtype_bytes: int) -> float:
    """The same for megatron-core's alltoall dispatcher, for comparison (not built by the engine, which runs
    the allgather one on gloo): each of a token's top-k copies leaves the rank with probability (ep - 1) / ep,
    out for the experts and back with their outputs."""
    if not cfg.is_moe or ep <= 1:
        return 0.0
    return 2 * cfg.moe_top_k * (ep - 1) / ep * cfg.hidden_size * dtype_bytes


def dispatch_time(cfg: DecoderConfig, tokens: float, tp: int, ep: int, dtype_bytes: int, device: DeviceSpec,
                  backward: bool = False) -> float:
    """One MoE layer's token exchange for `tokens` tokens of a micro-batch on a rank: the dispatcher's gathers
    and reduce-scatter run over the tp x ep group (consecutive ranks in megatron-core's order), three
    collectives out and one back forward, two and two backward."""
    if not cfg.is_moe or ep <= 1:
        return 0.0
    g = tp * ep
    received = tokens * dispatch_bytes_per_token(cfg, ep, dtype_bytes, backward)
    return received / link_bandwidth(device, g) + 4 * (g - 1) * device.link_latency


def expert_transition_bytes(cfg: DecoderConfig, tp: int, ep: int, dtype_bytes: int, pp: int = 1) -> float:
    """Bytes each rank receives gathering the other expert-parallel ranks' experts before generation:
    (ep - 1) / ep * X / tp, X the bytes of every layer's routed experts on a pipeline stage (docs/design.md,
    "Expert parallelism and its bytes"); the dense grouped gather (`transition_bytes`) follows over the whole
    model."""
    if ep <= 1:
        return 0.0
    return (ep - 1) / ep * expert_params(cfg) * (cfg.num_layers // pp) * dtype_bytes / tp


def transition_bytes(model_bytes: float, tp: int, pp: int, tg: int, pg: int = 1) -> float:
    """Bytes each rank receives when the 3D-HybridEngine (paper grouping) switches to generation:
    (t*p - tg*pg) / (tg*pg * t*p) * M (docs/design.md section 3)."""
    return (tp * pp - tg * pg) / (tg * pg * tp * pp) * model_bytes


def pipeline_factor(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """1F1B's time over the bubble-free time: (m + p - 1) / m; the interleaved schedule with v model chunks
    per rank shrinks the bubble v times but runs the m micro-batches padded to a multiple of p (megatron-
    core's interleaved schedule takes them in groups of p; the engine pads with full-size empty ones, which
    cost as much as real ones): (m' + (p - 1) / v) / m with m' = m rounded up to a multiple of p."""
    m = max(1, micro_batches)
    if vpp <= 1:
        return (m + pp - 1) / m
    return (interleaved_micro_batches(m, pp) + (pp - 1) / vpp) / m


def interleaved_micro_batches(micro_batches: int, pp: int) -> int:
    """The micro-batches the interleaved schedule runs: `micro_batches` rounded up to a multiple of p."""
    return -(-max(1, micro_batches) // pp) * pp


def chunks_in_flight(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """Stage-sized sets of activations the first pipeline rank holds at its peak: 1F1B keeps min(p, m)
    micro-batches of its layers; the interleaved schedule warms up 2(p - 1) + (v - 1)p chunk-micro-batches
    before its first backward (megatron-core's count for rank 0), each 1/v of the stage's layers."""
    if vpp <= 1:
        return float(min(pp, max(1, micro_batches)))
    return min(interleaved_micro_batches(micro_batches, pp) * vpp, 2 * (pp - 1) + (vpp - 1) * pp + 1) / vpp


def micro_batch_count(rows: int, dp: int, micro: int) -> int:
    """Micro-batches each data-parallel rank runs for `rows` rows split over `dp` ranks."""
    return max(1, math.ceil(rows / dp / max(1, micro)))
