"""The training engine: a megatron-core GPTModel built and loaded from an HF checkpoint.

`MegatronEngine` owns one model replica's shard on this rank: the GPTModel
(local layer spec, so it runs without Transformer Engine), Megatron DDP and
its (distributed) optimizer with an LR schedule. Roles (actor, critic,
reference in `hybridflow.workers`) hand it micro-batches and a loss
function; it never knows which algorithm runs (rule 6, docs/conventions.md).

Batches are RL sequences: a left-padded prompt followed by a right-padded
response, so real tokens are one contiguous run per row. Megatron's GPTModel
numbers positions 0..S-1 for every row, so each row is rotated to start at
column 0 before the forward pass and the outputs are rotated back; with only
right padding left, the plain causal mask is exact.
"""
from __future__ import annotations

import functools
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.config.schema import OptimConfig, ParallelConfig
from hybridflow.data import fields as F
from hybridflow.engine import cpu_layers
from hybridflow.engine.distributed import Layout, init_model_parallel
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import resolve_dtype
from hybridflow.models.config import DecoderConfig
from hybridflow.models.decoder import rope_inv_freq
from hybridflow.models.sharding import spec_for, unshard_tensor

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")

# A role's step function: (model output [B, S, ...] in the caller's column order,
# micro-batch) -> (scalar loss, metrics or outputs to collect).
StepFn = Callable[[Tensor, dict[str, Any]], tuple[Tensor, dict[str, Any]]]


def left_align_index(attention_mask: Tensor) -> Tensor:
    """Column gather index [B, S] that rotates each row's real tokens to column 0.

    Assumes one contiguous run of real tokens per row (left-padded prompt +
    right-padded response). `x.gather(1, idx)` aligns; `scatter` undoes it.
    """
    s = attention_mask.shape[-1]
    shift = (attention_mask.long().cumsum(-1) == 0).sum(-1, keepdim=True)  # leading pads
    return (torch.arange(s, device=attention_mask.device)[None] + shift) % s


def unalign(x: Tensor, idx: Tensor) -> Tensor:
    """Inverse of `x_aligned = x.gather(1, idx)` for x [B, S, ...]."""
    index = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.empty_like(x).scatter(1, index, x)


def pack_rows(aligned_ids: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Left-aligned rows [b, S] with `lengths` real tokens each -> one packed row of their real tokens.

    Returns ids [1, N] (N = lengths.sum()), position ids [1, N] restarting at 0
    for each sequence, and the attention mask [1, 1, N, N] (True = masked):
    causal within a sequence, nothing across sequences. No padding token is
    computed; attention scores are N x N, of which each sequence uses its block.
    """
    keep = torch.arange(aligned_ids.shape[1], device=aligned_ids.device)[None] < lengths[:, None]
    ids = aligned_ids[keep][None]
    positions = torch.cat([torch.arange(int(n), device=ids.device) for n in lengths])[None]
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths.to(ids.device))
    n = ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    allowed = causal & (segment[:, None] == segment[None, :])
    return ids, positions, ~allowed[None, None]


def unpack_rows(packed: Tensor, lengths: Tensor, width: int) -> Tensor:
    """Inverse of `pack_rows` for a model output [1, N, ...] -> [b, width, ...], zeros past each length."""
    rows = packed[0].split([int(n) for n in lengths])
    out = packed.new_zeros((len(rows), width, *packed.shape[2:]))
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def share_prompt_rows(aligned_ids: Tensor, lengths: Tensor,
                      prompt_lengths: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Left-aligned rows [b, S] -> one row per distinct prompt: the prompt once, then each of its rows' responses.

    GRPO samples n responses per prompt; run separately, each prompt's tokens
    are computed n times. Here a row's response tokens attend to the one copy
    of its prompt and to their own earlier tokens (never to another
    response), at the positions they have in their own sequence, so every
    output equals the separate rows' up to rounding. Rows share a prompt when
    its tokens are equal, wherever the rows sit in the micro-batch.

    Returns ids [U, L], position ids [U, L], the attention mask [U, 1, L, L]
    (True = masked) and index [b, S]: where each row's aligned column sits in
    the flattened [U * L] outputs, -1 past the row's length.
    """
    b, s = aligned_ids.shape
    device = aligned_ids.device
    col = torch.arange(s, device=device)[None]
    in_prompt = col < prompt_lengths[:, None]
    _, group = torch.unique(aligned_ids.masked_fill(~in_prompt, -1), dim=0, return_inverse=True)
    width: dict[int, int] = {}  # per prompt: slots used so far (its prompt, then its responses so far)
    starts = []
    for g, prompt, total in zip(group.tolist(), prompt_lengths.tolist(), lengths.tolist()):
        start = width.setdefault(g, prompt)
        starts.append(start)
        width[g] = start + total - prompt
    u, L = len(width), max(width.values())
    start = torch.tensor(starts, device=device)[:, None]
    base = group[:, None] * L
    index = torch.where(in_prompt, base + col, base + start + col - prompt_lengths[:, None])
    valid = col < lengths[:, None]
    index = index.masked_fill(~valid, -1)
    slots = index[valid]
    ids = aligned_ids.new_zeros(u * L)
    ids[slots] = aligned_ids[valid]  # a prompt's slots are written by each of its rows, with the same tokens
    positions = torch.zeros(u * L, dtype=torch.long, device=device)
    positions[slots] = col.expand(b, s)[valid]
    owner = torch.full((u * L,), -2, dtype=torch.long, device=device)  # -2 padding, -1 prompt, else the row
    owner[slots] = torch.arange(b, device=device)[:, None].expand(b, s).masked_fill(in_prompt, -1)[valid]
    owner = owner.view(u, L)
    slot = torch.arange(L, device=device)
    allowed = (slot[None, :, None] >= slot[None, None, :]) & (owner[:, None, :] != -2) & (owner[:, :, None] != -2)
    allowed &= (owner[:, None, :] == -1) | (owner[:, None, :] == owner[:, :, None])
    allowed |= torch.eye(L, dtype=torch.bool, device=device)[None]  # a padding slot sees itself: no NaN
    return ids.view(u, L), positions.view(u, L), ~allowed[:, None], index


def unshare_rows(output: Tensor, index: Tensor) -> Tensor:
    """Inverse of `share_prompt_rows` for a model output [U, L, ...] -> [b, S, ...], zeros past each length.
    A prompt's outputs go to each of its rows (the gather's backward sums their gradients)."""
    flat = output.reshape(-1, *output.shape[2:])
    out = flat[index.clamp(min=0)]
    return out.masked_fill((index < 0).view(*index.shape, *([1] * (out.dim() - 2))), 0)


def to_cpu(value: Any) -> Any:
    """`value` with every tensor in it on the CPU: what an object collective may send.

    `broadcast_object_list` rebuilds a CUDA tensor on the *sender's* device
    index, so under torchrun (one process per GPU) a receiver would fill
    another rank's GPU; a CPU copy lands where the receiver puts it.
    """
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def pad_rows(batch: dict[str, Any], rows: int) -> dict[str, Any]:
    """Append all-zero rows (no real tokens, masks 0) to every tensor field until it has `rows` rows."""
    out = {}
    for key, value in batch.items():
        extra = rows - len(value)
        out[key] = torch.cat([value, value.new_zeros(extra, *value.shape[1:])]) if extra > 0 else value
    return out


class ValueHead(nn.Module):
    """The critic's output layer: hidden -> one value, replicated across TP."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, dtype=dtype))

    def forward(self, hidden_states: Tensor, weight=None, runtime_gather_output=None):
        return hidden_states @ self.weight.t(), None


class UnsafeCheckpointError(ValueError):
    """A checkpoint shard that only a full unpickle (which can run code) would read."""


@dataclass
class Traffic:
    """What one rank sent and received in a weight transfer, and the collectives it joined.

    Bytes are logical: what the collective delivers from this rank to others
    and from others to it (an all-gather over k ranks sends the own buffer to
    k - 1 peers; a broadcast's root sends it to every other member),
    whatever algorithm the backend runs underneath.
    """

    bytes_received: int = 0
    bytes_sent: int = 0
    collectives: int = 0

    def add(self, received: int, sent: int = 0) -> None:
        """One collective this rank joined."""
        self.bytes_received += received
        self.bytes_sent += sent
        self.collectives += 1


@dataclass
class StepStats:
    grad_norm: float  # NaN when the optimizer skipped the step
    lr: float


def transformer_config(cfg: DecoderConfig, parallel: ParallelConfig, dtype: torch.dtype, device: str,
                       layer_kernels: bool = True):
    from megatron.core.transformer import TransformerConfig

    if len(set(cfg.layer_windows)) > 1:
        raise NotImplementedError("the Megatron engine supports one attention window for all layers; "
                                  f"this model has {sorted(set(map(str, cfg.layer_windows)))}")
    window = cfg.layer_windows[0] if cfg.layer_windows else None
    # On CPU the norms, the SwiGLU and the rotation run hybridflow's one-pass kernels (engine/cpu_layers.py).
    cpu_kernels = device == "cpu" and layer_kernels and cpu_layers.install_rope()
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads, num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=cpu_kernels,
        use_te_activation_func=cpu_kernels,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        window_size=None if window is None else (window - 1, 0),
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        pipeline_dtype=dtype,
        context_parallel_size=parallel.cp, sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=device == "cpu", perform_initialization=False)


def mark_tensor_parallel(model: nn.Module, value_head: bool = False) -> None:
    """Tag each parameter with megatron-core's TP attributes, from the sharding plan.

    megatron-core 0.16 sets `tensor_model_parallel` on a layer's weight only
    while initializing it; built with `perform_initialization=False` (weights
    come from a checkpoint) the weights of its TP layers are left untagged.
    The optimizer then counts every untagged parameter on TP rank 0 only as a
    "duplicate", so the gradient norm (and clipping) misses the other ranks'
    shards: at tp=2 it measured 1.51 where the single-rank norm is 1.91.
    """
    from megatron.core.tensor_parallel.layers import (set_defaults_if_not_set_tensor_model_parallel_attributes,
                                                      set_tensor_model_parallel_attributes)

    for name, param in model.named_parameters():
        if hasattr(param, "tensor_model_parallel"):  # megatron-core tagged it (biases are)
            continue
        spec = None if value_head and name == "output_layer.weight" else spec_for(name)  # the value head is replicated
        if spec is not None and spec.dim is not None:
            set_tensor_model_parallel_attributes(param, True, spec.dim, 1)
        else:
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam(W) steps inside a megatron-core optimizer to torch's fused CPU kernel.

    Without Transformer Engine or apex, megatron-core builds `torch.optim.AdamW` with torch's defaults, which
    on CPU tensors is the per-parameter loop: ~10 ops per tensor per step (measured on the demo model's 27
    tensors: 5.1 ms a step, fused 0.9 ms). The fused kernel computes the same update in one pass per tensor.
    Returns how many param groups were switched.
    """
    switched = 0
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_opt.param_groups:
            if all(p.device.type == "cpu" for p in group["params"]) and not group.get("differentiable"):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


class MegatronEngine:
    """One rank's shard of a megatron-core GPTModel, its DDP wrapper and optimizer.

    optim=None builds a frozen, forward-only engine (the reference policy).
    value_head=True replaces the vocabulary output layer by a scalar head (the critic).
    fused_output=True (at tp = 1) leaves the output layer to the loss: the model
    returns its final hidden states [b, s, H] and `output_weight` is the layer's
    weight, which `roles.batching.response_log_probs` applies on the response
    positions only, fused with the log-prob (`kernels.fused_linear`), so no
    [tokens, vocab] logits are ever held. `self.fused_output` says which.
    layer_kernels=True (on CPU) runs the norms, SwiGLU and RoPE as one-pass C++ kernels (engine/cpu_layers.py).
    """

    def __init__(self, model_cfg: DecoderConfig, parallel: ParallelConfig,
                 optim: Optional[OptimConfig] = None, *, device: str = "cpu", dtype: str = "float32",
                 make_vocab_size_divisible_by: int = 128, value_head: bool = False,
                 total_steps: int = 1, seed: int = 0, fused_output: bool = False, layer_kernels: bool = True):
        if device == "cpu":
            from hybridflow.engine import cpu_compat
            cpu_compat.apply()
        self.cfg, self.parallel, self.device = model_cfg, parallel, device
        self.dtype = resolve_dtype(dtype)
        self.value_head = value_head
        self.layout: Layout = init_model_parallel(parallel, device)
        # The vocab-parallel (tp > 1) log-prob needs the sharded logits; there the layer stays.
        self.fused_output = fused_output and not value_head and parallel.tp == 1
        self.output_weight: Optional[Tensor] = None  # set by each forward when fused_output
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(seed)  # Megatron's named RNG streams
        self.bridge = get_bridge(model_cfg, make_vocab_size_divisible_by, parallel.tp)
        self.tconfig = transformer_config(model_cfg, parallel, self.dtype, device, layer_kernels)
        self.module = self._build_model()
        self.optimizer = self.scheduler = None
        self.model: nn.Module = self.module
        if optim is not None:
            self._build_ddp_and_optimizer(optim, total_steps)
        else:
            self.module.requires_grad_(False)
            self.module.eval()

    # -- construction ---------------------------------------------------------
    def _build_model(self) -> nn.Module:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        cfg = self.cfg
        model = GPTModel(
            config=self.tconfig, transformer_layer_spec=(
                cpu_layers.layer_spec(self.tconfig) if self.tconfig.use_te_activation_func
                else get_gpt_layer_local_spec(normalization="RMSNorm")),
            vocab_size=self.bridge.padded_vocab, max_sequence_length=cfg.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings and not self.value_head)
        # RoPE frequencies (incl. linear / llama3 scaling) come from the one
        # definition the plain decoder uses, so both layouts agree exactly.
        model.rotary_pos_emb.inv_freq = rope_inv_freq(cfg).to(self._torch_device())
        self._position_rope(model.rotary_pos_emb)
        if self.value_head and model.post_process:
            model.output_layer = ValueHead(cfg.hidden_size, self.dtype)
        if self.fused_output and model.post_process:
            self._defer_output_layer(model.output_layer)
        model.to(self._torch_device())
        mark_tensor_parallel(model, self.value_head)
        if self.dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module
            model = Float16Module(self.tconfig, model)
        return model

    def _defer_output_layer(self, layer: nn.Module) -> None:
        """The layer hands its input back (and notes the weight it would have used: its own, or the
        tied embedding that GPTModel passes in). Patched on the instance, so parameter names,
        checkpoints and the bridge are unchanged."""
        engine = self

        def hidden_out(input_, weight=None, runtime_gather_output=None, **_):
            engine.output_weight = layer.weight if weight is None else weight
            return input_, None

        layer.forward = hidden_out

    def _position_rope(self, rope: nn.Module) -> None:
        """GPTModel rotates a row's token j as position j. While `self.rope_positions` [b, s] is set, the
        rotary module returns the angles of those positions instead, per row (`[s, b, 1, dim]`, which the
        unfused RoPE broadcasts over heads): what shared-prompt rows need. Patched on the instance."""
        plain = rope.forward
        self.rope_positions: Optional[Tensor] = None

        def positioned(max_seq_len, *args, **kwargs):
            if self.rope_positions is None:
                return plain(max_seq_len, *args, **kwargs)
            inv_freq = rope.inv_freq.to(self.rope_positions.device)
            freqs = self.rope_positions.t()[..., None].to(inv_freq.dtype) * inv_freq  # [s, b, dim / 2]
            return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]

        rope.forward = positioned

    def _torch_device(self) -> torch.device:
        return torch.device("cpu") if self.device == "cpu" else torch.device("cuda", torch.cuda.current_device())

    def _build_ddp_and_optimizer(self, optim: OptimConfig, total_steps: int) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.distributed_optimizer)
        self.model = DistributedDataParallel(self.tconfig, ddp_cfg, self.module)
        self.tconfig.no_sync_func = self.model.no_sync
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        ocfg = OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
            clip_grad=optim.grad_clip, bf16=self.dtype == torch.bfloat16, fp16=False,
            params_dtype=self.dtype, use_distributed_optimizer=self.distributed_optimizer)
        self.optimizer = get_megatron_optimizer(ocfg, [self.model])
        if self.device == "cpu":
            use_fused_adam(self.optimizer)
        decay = max(1, total_steps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr,
            min_lr=optim.min_lr, lr_warmup_steps=optim.warmup_steps,
            lr_decay_steps=max(decay, optim.warmup_steps + 1), lr_decay_style=optim.lr_schedule,
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay,
            wd_incr_style="constant")

    @property
    def distributed_optimizer(self) -> bool:
        """Whether Adam state is sharded over the DP ranks: as configured, and only where dp > 1.

        At dp = 1 it shards nothing, and its parameter all-gather runs on gloo's
        work thread, whose first ATen op starts a second OpenMP team; libgomp
        then has more threads than cores and stops spinning, so every later
        small op of the process pays a futex wake-up (measured: a 16x64 @ 64x128
        matmul 13 -> 30-50 us, for the rest of the run). docs/megatron-on-cpu.md.
        """
        return self.parallel.distributed_optimizer and self.layout.dp > 1

    # -- weights --------------------------------------------------------------
    def _inner(self) -> nn.Module:
        return self.module.module if hasattr(self.module, "module") else self.module

    def _named_params(self) -> dict[str, Tensor]:
        """This rank's parameters under megatron-core's *local* names (layers numbered per stage)."""
        return dict(self._inner().named_parameters())

    @property
    def stage_layers(self) -> range:
        """Global indices of the decoder layers on this pipeline stage."""
        layers = self._inner().decoder.layers
        first = layers[0].layer_number - 1 if len(layers) else 0
        return range(first, first + len(layers))

    def _stage_entries(self) -> list[tuple[Any, str]]:
        """(bridge entry, local name) of every bridge tensor on this stage.

        megatron-core numbers `decoder.layers.N` from 0 on every stage; the
        bridge and HF checkpoints number layers globally.
        """
        names, layers, out = self._named_params().keys(), self.stage_layers, []
        for entry in self.bridge.entries():
            if self.value_head and entry.megatron == "output_layer.weight":
                continue
            match = _LAYER.match(entry.megatron)
            if match is None:
                local = entry.megatron if entry.megatron in names else None
            else:
                index = int(match[1])
                local = f"decoder.layers.{index - layers.start}.{match[2]}" if index in layers else None
            if local is not None:
                out.append((entry, local))
        return out

    def _tied_output_copy(self) -> bool:
        """The last stage's copy of a tied embedding (pp > 1): loaded from the embedding, never exported."""
        return (self.cfg.tie_word_embeddings and not self.value_head and self.parallel.pp > 1
                and "output_layer.weight" in self._named_params())

    def load_hf_state_dict(self, hf: dict[str, Tensor]) -> None:
        """Copy full HF tensors (in memory) into this rank's shards, in place."""
        from hybridflow.models.checkpoint import TensorsReader

        self._load(TensorsReader(hf))

    def load_hf_checkpoint(self, path: str | Path) -> int:
        """Load this rank's shards from an HF safetensors checkpoint, reading only its own slices
        (`safe_open(...).get_slice`): no rank loads the whole model. Returns the bytes read."""
        from hybridflow.models.checkpoint import SafetensorsReader

        with SafetensorsReader(path) as read:
            self._load(read)
        return read.bytes_read

    @torch.no_grad()
    def _load(self, read) -> None:
        """Copy this rank's slices, as `read` (a `bridge.SliceReader`) gives them, into its parameters in
        place (DDP buffers keep their storage)."""
        params = self._named_params()
        tp_rank, tp = self.layout.tp_rank, self.layout.tp
        self.bridge.check_hf_names(read.keys())
        for entry, local in self._stage_entries():
            params[local].copy_(self.bridge.read_shard(entry, read, tp_rank, tp))
        if self._tied_output_copy():
            embedding = next(e for e in self.bridge.entries() if e.megatron == "embedding.word_embeddings.weight")
            params["output_layer.weight"].copy_(self.bridge.read_shard(embedding, read, tp_rank, tp))
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def stage_state(self, traffic: Optional["Traffic"] = None) -> dict[str, Tensor]:
        """This stage's tensors, gathered over TP, under global megatron names (each its own copy)."""
        from megatron.core import parallel_state as ps

        params, out = self._named_params(), {}
        for entry, local in self._stage_entries():
            tensor = params[local].detach()
            if self.layout.tp > 1 and entry.shard.dim is not None:
                pieces = [torch.empty_like(tensor) for _ in range(self.layout.tp)]
                dist.all_gather(pieces, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
                if traffic is not None:
                    moved = tensor.numel() * tensor.element_size() * (self.layout.tp - 1)
                    traffic.add(moved, moved)  # an all-gather: as much out to the peers as in from them
                tensor = unshard_tensor(pieces, entry.shard)
            out[entry.megatron] = tensor.clone()
        return out

    def full_state(self, traffic: Optional["Traffic"] = None) -> dict[str, Tensor]:
        """The whole model on every rank (global megatron names): TP all-gathers, then one broadcast
        per pipeline stage over the pipeline group; `traffic` counts what this rank received.

        This is the plain full gather (DeepSpeed-Chat style), one collective per
        tensor: the baseline the 3D-HybridEngine's grouped gather replaces.
        """
        full: dict[str, Tensor] = {}
        for part in self.each_stage(self.stage_state(traffic), traffic):
            full.update(part)
        return full

    def each_stage(self, mine: dict[str, Tensor], traffic: Optional["Traffic"] = None):
        """Every pipeline stage's `mine`, in stage order (a generator every rank of the pipeline runs through).

        Each stage broadcasts its dict over the pipeline group in turn, so a
        rank holds at most its own and one other stage's; `traffic` counts
        every broadcast a rank joins, and the bytes of the ones it receives.
        """
        if self.parallel.pp == 1:
            yield mine
            return
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        for stage, src in enumerate(dist.get_process_group_ranks(group)):
            own = stage == self.layout.pp_rank
            box = [to_cpu(mine) if own else None]
            dist.broadcast_object_list(box, src=src, group=group)
            if traffic is not None:
                size = sum(t.numel() * t.element_size() for t in box[0].values())
                if own:  # the root sends its stage to every other stage
                    traffic.add(0, size * (self.parallel.pp - 1))
                else:
                    traffic.add(size)
            yield box[0]

    def hf_stage_parts(self):
        """The model in HF names, one pipeline stage at a time (a generator every rank must run through):
        what a streamed export writes as it goes."""
        for part in self.each_stage(self.stage_state()):
            yield self.bridge.megatron_to_hf(part, partial=self.parallel.pp > 1)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The full model in HF names and layout (gathered over TP, then stage by stage over PP)."""
        if self.value_head:
            raise NotImplementedError("a critic is not an HF causal LM; save it with state_dict()")
        return self.bridge.megatron_to_hf(self.full_state())

    def generation_state(self) -> dict[str, Tensor]:
        """Generation-layout names -> *views* of this rank's parameters (tp = pp = 1: the whole model)."""
        if self.layout.tp > 1 or self.parallel.pp > 1:
            raise NotImplementedError("a sharded engine has no whole-model views; gather it (full_state)")
        return self.bridge.megatron_to_generation(self._named_params())

    # -- compute --------------------------------------------------------------
    def _forward_step(self, step_fn: StepFn, packed: bool, share_prompts: bool, data_iterator, model):
        batch, rows = next(data_iterator)
        idx = left_align_index(batch[F.ATTENTION_MASK])
        ids = batch[F.INPUT_IDS].gather(1, idx).to(self._torch_device())
        s = ids.shape[1]
        if packed:  # the micro-batch's sequences back to back in one row: no padding token is computed
            lengths = batch[F.ATTENTION_MASK].sum(-1).to(ids.device)
            packed_ids, positions, mask = pack_rows(ids, lengths)
            output = unpack_rows(model(packed_ids, positions, mask), lengths, s)
        elif share_prompts:  # each distinct prompt computed once, its rows' responses after it
            mask = batch[F.ATTENTION_MASK].to(ids.device)
            prompt_width = s - batch[F.RESPONSES].shape[1]
            shared_ids, positions, shared_mask, index = share_prompt_rows(
                ids, mask.sum(-1), mask[:, :prompt_width].sum(-1))
            self.rope_positions = positions
            try:
                output = unshare_rows(model(shared_ids, positions, shared_mask), index)
            finally:
                self.rope_positions = None
        else:
            positions = torch.arange(s, device=ids.device)[None].expand_as(ids)
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), 1)[None, None]
            output = model(ids, positions, causal)
        return output, functools.partial(self._loss, step_fn, batch, idx, rows)

    @staticmethod
    def _loss(step_fn: StepFn, batch: dict[str, Any], idx: Tensor, rows: int, output: Tensor):
        output = unalign(output, idx.to(output.device))
        # The micro-batch arrives as the controller sent it (CPU); the loss is computed where the model ran.
        batch = {k: v.to(output.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        if output.shape[-1] == 1:
            output = output.squeeze(-1)
        if rows < len(output):  # rows added only to give every pipeline micro-batch one shape
            output, batch = output[:rows], {k: v[:rows] for k, v in batch.items()}
        return step_fn(output, batch)

    def run(self, micro_batches: list[dict[str, Any]], step_fn: StepFn,
            forward_only: bool = False, packed: bool = False,
            share_prompts: bool = False) -> list[dict[str, Any]]:
        """Forward (and backward) over micro-batches; returns what each step_fn reported, on every rank.

        Each micro-batch holds at least INPUT_IDS and ATTENTION_MASK [b, S] (`data.fields`).
        Megatron divides each loss by len(micro_batches), so a step_fn that
        returns its micro-batch's share of the mini-batch loss times
        len(micro_batches) gives exactly the mini-batch gradient. At pp > 1
        micro-batches are padded with empty rows to one shape (the pipeline
        sends fixed-shape activations; step_fn never sees the padding), and
        the reports, which only the last stage computes, are broadcast to the
        pipeline's other stages. packed=True runs each micro-batch as one row
        of its real tokens (`pack_rows`; pp = 1, full attention only); step_fn
        sees the same [b, S, ...] output either way. share_prompts=True runs
        the rows that share a prompt as one row, the prompt computed once
        (`share_prompt_rows`; pp = 1, cp = 1, full attention; each micro-batch
        holds RESPONSES, which mark where prompts end).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not forward_only and self.optimizer is None:
            raise RuntimeError("this engine is frozen (built without an optimizer)")
        if packed and (self.parallel.pp > 1 or any(w is not None for w in self.cfg.layer_windows)):
            raise ValueError("packed micro-batches need pp = 1 and full attention in every layer")
        if share_prompts and (packed or self.parallel.pp > 1 or self.parallel.cp > 1
                              or any(w is not None for w in self.cfg.layer_windows)):
            raise ValueError("shared-prompt micro-batches need pp = 1, cp = 1, full attention in every layer "
                             "and no token packing")
        rows = [len(mb[F.INPUT_IDS]) for mb in micro_batches]
        size = max(rows)
        data = [(pad_rows(mb, size) if self.parallel.pp > 1 else mb, n) for mb, n in zip(micro_batches, rows)]
        self.model.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            reports = get_forward_backward_func()(
                forward_step_func=functools.partial(self._forward_step, step_fn, packed, share_prompts),
                data_iterator=iter(data), model=[self.model],
                num_microbatches=len(data), seq_length=data[0][0][F.INPUT_IDS].shape[1],
                micro_batch_size=data[0][0][F.INPUT_IDS].shape[0], forward_only=forward_only)
        return self._from_last_stage(to_cpu(reports))  # reports leave the engine as CPU tensors, like batches

    def _from_last_stage(self, reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.parallel.pp == 1:
            return reports
        from megatron.core import parallel_state as ps

        last = ps.is_pipeline_last_stage()
        box = [reports if last else None]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return reports if last else box[0]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> StepStats:
        """Apply accumulated gradients (clip, Adam, LR schedule)."""
        _, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        return StepStats(grad_norm=float("nan") if grad_norm is None else float(grad_norm), lr=lr)

    # -- checkpoints (this rank's shard) --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": {k: v.detach().clone() for k, v in self._named_params().items()}}
        if self.optimizer is not None and self._has_stepped():
            state["optimizer"] = self.optimizer.state_dict()
            state["optimizer_params"] = [_param_state(opt) for opt in self.optimizer.chained_optimizers]
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _has_stepped(self) -> bool:
        """Adam state exists only after the first step (Megatron cannot save it before)."""
        return any(len(opt.optimizer.state) for opt in self.optimizer.chained_optimizers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self._check_optimizer_kind(state)
        params = self._named_params()
        with torch.no_grad():
            for name, value in state["model"].items():
                params[name].copy_(value)
        if self.optimizer is not None and "optimizer" in state:
            self._load_optimizer(state)

    def _check_optimizer_kind(self, state: dict[str, Any]) -> None:
        saved = any(p is not None for p in state["optimizer_params"])
        if saved != self.distributed_optimizer:
            raise ValueError(
                f"this checkpoint's optimizer state was written {'with' if saved else 'without'} the distributed "
                f"optimizer and this run uses {'it' if self.distributed_optimizer else 'none'} (it is used where the "
                f"role's parallel.distributed_optimizer is true and dp > 1; dp here is {self.layout.dp}); resume "
                "with the layout it was saved at, or load the weights alone (the HF export)")

    @torch.no_grad()
    def _load_optimizer(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for opt, pstate in zip(self.optimizer.chained_optimizers, state["optimizer_params"]):
            if pstate is not None:
                opt.load_parameter_state_from_dp_reshardable(pstate)
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer.reload_model_params()
        # Megatron's loader hands every parameter the *same* Adam step tensor;
        # torch's AdamW then bumps it once per parameter per step. Unshare it.
        for opt in self.optimizer.chained_optimizers:
            for param_state in opt.optimizer.state.values():
                if torch.is_tensor(param_state.get("step")):
                    param_state["step"] = param_state["step"].clone()

    def shard_path(self, directory: Path) -> Path:
        """This rank's file inside a checkpoint directory."""
        lay = self.layout
        return Path(directory) / f"engine_tp{lay.tp_rank}_pp{lay.pp_rank}_dp{lay.dp_rank}.pt"

    def save(self, directory: Path) -> None:
        """Write this rank's shard (`state_dict`) into `directory`."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), self.shard_path(directory))

    def load(self, directory: Path) -> None:
        """Restore this rank's shard written by `save`.

        Read with `weights_only=True`: tensors and plain containers only. A
        full unpickle would run whatever code a crafted shard names, on
        every rank, during `trainer.resume=auto`; such a shard is refused.
        """
        path = self.shard_path(directory)
        try:
            state = torch.load(path, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = next((line.strip() for line in str(exc).splitlines() if "unsupported global" in line.lower()), "")
            raise UnsafeCheckpointError(f"{path}: refusing to load a checkpoint shard that holds more than "
                                        f"tensors and plain data (loading it could run code). {found}") from None
        self.load_state_dict(state)



def _param_state(opt) -> Optional[dict]:
    """A distributed optimizer's own shard of Adam state, in the form its loader reads back."""
    if not hasattr(opt, "get_parameter_state_dp_reshardable"):
        return None
    state = opt.get_parameter_state_dp_reshardable()
    for gbuf_idx, by_dtype in state.items():
        if isinstance(gbuf_idx, int):
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for elem in bucket:
                        elem.setdefault("padding", False)  # the loader filters on this key
    return state
