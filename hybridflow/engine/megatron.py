"""The training engine: a megatron-core GPTModel built and loaded from an HF checkpoint.

`MegatronEngine` owns one model replica's shard on this rank: the GPTModel (built in `build.py`),
Megatron DDP and its (distributed) optimizer with an LR schedule, and the weight I/O (HF load and
export, the TP/PP gathers, this rank's checkpoint shard). Roles (`hybridflow.roles`) hand it
micro-batches and a loss function; it never knows which algorithm runs (rule 6).

Rows are a left-padded prompt then a right-padded response. GPTModel numbers positions 0..S-1 in every
row, so each row is rotated to start at column 0 before the forward pass and rotated back after; with
only right padding left, the plain causal mask is exact (`packing.py`).
"""
from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.checkpoint.format import optimizer_param_state, shard_file
from hybridflow.config.schema import LoRAConfig, OptimConfig, ParallelConfig
from hybridflow.data import fields as F
from hybridflow.data.batch import pad_with_empty_rows, slice_rows
from hybridflow.engine.build import (HiddenOutput, RopePositions, build_model, lr_scheduler, transformer_config,
                                     use_fused_adam)
from hybridflow.engine.cp_attention import context_parallel_forward
from hybridflow.engine.distributed import expert_group, expert_parallel_rank, init_model_parallel
from hybridflow.engine.experts import ExpertShard, exchange_experts
from hybridflow.engine.lora import LoRA, attach_lora, trainable
from hybridflow.engine.moe import RouterStats, forward_with_padding
from hybridflow.engine.routes import RouteReplay, input_tags
from hybridflow.engine.packing import (left_align_index, pack_rows, pad_columns, padded_width, share_prompt_rows,
                                       shared_lengths, to_cpu, unalign, unpack_sequences, unshare_rows)
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import resolve_dtype
from hybridflow.models.config import DecoderConfig
from hybridflow.models.sharding import unshard_tensor
from hybridflow.parallel.layout import Coord, ParallelDims
from hybridflow.parallel.stages import chunk_layers, chunk_name, local_name, param_stage

# A role's step function: (model output [B, S, ...] in the caller's column order,
# micro-batch) -> (scalar loss, metrics or outputs to collect).
StepFn = Callable[[Tensor, dict[str, Any]], tuple[Tensor, dict[str, Any]]]


class TrafficCounter(Protocol):
    """What counts a weight transfer's collectives (`hybrid_engine.traffic.Traffic`): one `add` per
    collective this rank joins, with the bytes it received and sent."""

    def add(self, received: int, sent: int = 0) -> None: ...


class UnsafeCheckpointError(ValueError):
    """A checkpoint shard that only a full unpickle (which can run code) would read."""


@dataclass
class StepStats:
    grad_norm: float  # NaN when the optimizer skipped the step
    lr: float
    router: dict[str, float] = field(default_factory=dict)  # an MoE model's `RouterStats.read()`


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


class MegatronEngine:
    """One rank's shard of a megatron-core GPTModel, its DDP wrapper and optimizer.

    optim=None builds a frozen, forward-only engine (the reference policy); value_head=True replaces the vocabulary
    output layer by a scalar head (the critic). fused_output=True (tp = 1 only; see `self.fused_output`) makes the
    model return its final hidden states [b, s, H] and leaves `output_weight` to the loss, which applies it on the
    response positions only (`kernels.fused_linear`), so no [tokens, vocab] logits are held. layer_kernels=True
    (CPU) runs the norms, SwiGLU and RoPE as C++ kernels (engine/cpu_layers.py). aux_loss_coeff, z_loss_coeff: an
    MoE model's load-balancing and z losses (0: off); `step` reports its routers (`moe.RouterStats`). layout:
    the run plan's `ParallelDims` for this role (checked against the process group; default: the world at
    `parallel`'s degrees), kept as `self.layout`, with this rank's `self.coord`. virtual_pp = v > 1: the rank holds
    v model chunks (`self.chunks`; `self.models` their DDP wrappers, one optimizer over all), chunk c of stage s
    holding `parallel.stages.chunk_layers(s, c, ...)`. `self.module` and `self.model` are the first chunk and its
    wrapper. lora (rank > 0): the base frozen, adapters trained (`self.lora`, `engine/lora.py`).
    """

    kind = "megatron"

    def __init__(self, model_cfg: DecoderConfig, parallel: ParallelConfig,
                 optim: Optional[OptimConfig] = None, *, device: str = "cpu", dtype: str = "float32",
                 make_vocab_size_divisible_by: int = 128, value_head: bool = False,
                 total_steps: int = 1, seed: int = 0, fused_output: bool = False, layer_kernels: bool = True,
                 layout: Optional[ParallelDims] = None, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 lora: Optional[LoRAConfig] = None):
        if device == "cpu":
            from hybridflow.engine import cpu_compat
            cpu_compat.apply()
        self.cfg, self.parallel, self.device = model_cfg, parallel, device
        self.dtype = resolve_dtype(dtype)
        self.value_head = value_head
        self.layout: ParallelDims = init_model_parallel(parallel, device, layout)
        self.rank = dist.get_rank()
        self.coord: Coord = self.layout.coord(self.rank)
        # The vocab-parallel (tp > 1) log-prob needs the sharded logits; there the layer stays.
        self.fused_output = fused_output and not value_head and self.layout.tp == 1
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(seed)  # Megatron's named RNG streams
        self.bridge = get_bridge(model_cfg, make_vocab_size_divisible_by, self.layout.tp)
        self.tconfig = transformer_config(model_cfg, parallel, self.dtype, device, layer_kernels, aux_loss_coeff,
                                          z_loss_coeff)
        self.rope = RopePositions()  # per-row positions for shared-prompt rows (`_forward_step`)
        self.virtual_pp = parallel.virtual_pp or 1
        self.chunks: list[nn.Module] = [
            build_model(model_cfg, self.tconfig, self.bridge.padded_vocab, self.dtype, self.torch_device,
                        self.rope, value_head=value_head, fused_output=self.fused_output,
                        vp_stage=c if self.virtual_pp > 1 else None) for c in range(self.virtual_pp)]
        self._check_chunk_layers()
        self.router_stats = RouterStats(self.chunks, model_cfg)
        # parallel.ep > 1: this rank's experts of each layer (`engine/experts.py`), named from 0 by megatron-core.
        self.experts = ExpertShard(model_cfg.num_experts, parallel.ep, expert_parallel_rank(parallel.ep))
        self.routes = RouteReplay(self.chunks, model_cfg.num_layers, model_cfg.moe_top_k)  # engine/routes.py
        self.lora: Optional[LoRA] = (attach_lora(self.chunks, lora, self.layout.tp, self.coord.tp, seed,
                                                 self.experts) if lora is not None and lora.rank > 0 else None)
        self.module = self.chunks[0]
        self.optimizer = self.scheduler = None
        self.models: list[nn.Module] = list(self.chunks)
        if optim is not None:
            self._build_ddp_and_optimizer(optim, total_steps)
        else:
            for chunk in self.chunks:
                chunk.requires_grad_(False)
                chunk.eval()
        self.model: nn.Module = self.models[0]

    # -- construction ---------------------------------------------------------
    @property
    def torch_device(self) -> torch.device:
        """Where this rank's model lives: the CPU, or the process's current CUDA device."""
        return torch.device("cpu") if self.device == "cpu" else torch.device("cuda", torch.cuda.current_device())

    def _build_ddp_and_optimizer(self, optim: OptimConfig, total_steps: int) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.distributed_optimizer)
        # As megatron-core's own `get_model`: one DDP per chunk, the later chunks' buffers in one bucket.
        self.models = [DistributedDataParallel(self.tconfig, ddp_cfg, chunk, disable_bucketing=c > 0)
                       for c, chunk in enumerate(self.chunks)]
        no_sync = [m.no_sync for m in self.models]
        self.tconfig.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        ocfg = OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
            clip_grad=optim.grad_clip, bf16=self.dtype == torch.bfloat16, fp16=False,
            params_dtype=self.dtype, use_distributed_optimizer=self.distributed_optimizer)
        self.optimizer = get_megatron_optimizer(ocfg, self.models)
        if self.device == "cpu":
            use_fused_adam(self.optimizer)
        self.scheduler = lr_scheduler(self.optimizer, optim, total_steps)

    @property
    def distributed_optimizer(self) -> bool:
        """Whether Adam state is sharded over the DP ranks: as configured, and only where dp > 1.

        At dp = 1 it shards nothing, and its all-gather on gloo's work thread starts a second OpenMP
        team, which slows every later small op of the process (docs/megatron-on-cpu.md).
        """
        return self.parallel.distributed_optimizer and self.layout.dp > 1

    @property
    def data_parallel_group(self):
        """The group a mini-batch's rows are split over (the roles sum losses and metrics over it)."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    @property
    def tensor_parallel_group(self):
        """The group the vocabulary is split over (the vocab-parallel log-prob reduces over it)."""
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group()

    # -- weights --------------------------------------------------------------
    def _inner(self, chunk: int = 0) -> nn.Module:
        from megatron.core.utils import unwrap_model  # the GPTModel inside Float16Module below float32
        return unwrap_model(self.chunks[chunk])

    def _check_chunk_layers(self) -> None:
        """Each chunk's layers are where `parallel.stages` (the plans, the reshard tool) says they are."""
        for c in range(self.virtual_pp):
            layers = self._inner(c).decoder.layers
            built = [layer.layer_number - 1 for layer in layers]
            want = list(chunk_layers(self.coord.pp, c, self.cfg.num_layers, self.layout.pp, self.virtual_pp))
            if built != want:
                raise RuntimeError(f"megatron-core built layers {built} as chunk {c} of stage {self.coord.pp}; "
                                   f"parallel.stages places {want} there")

    @property
    def output_weight(self) -> Optional[Tensor]:
        """With fused_output, the weight the output layer was to apply in the last forward pass (its own,
        or the tied embedding); None before the first one and on stages without the output layer."""
        layer = getattr(self._inner(self.virtual_pp - 1), "output_layer", None)
        weight = layer.used_weight if isinstance(layer, HiddenOutput) else None
        if weight is not None and self.layout.cp > 1:
            # At cp > 1 every CP rank applies it to the whole gathered output, so each holds the weight's
            # full gradient, which the schedule's x cp and DDP's average over dp x cp would count cp times;
            # the layers before it see only their own chunks' gradient (the gather's backward slices).
            weight = _ScaleGrad.apply(weight, 1.0 / self.layout.cp)
        return weight

    def named_params(self) -> dict[str, Tensor]:
        """This rank's parameters under megatron-core's *local* names (layers numbered per chunk), each
        chunk's prefixed by it at virtual_pp > 1 (`parallel.stages.local_name`)."""
        return {chunk_name(c, name, self.virtual_pp): p for c in range(self.virtual_pp)
                for name, p in self._inner(c).named_parameters()}

    def local_name(self, megatron_name: str, experts: Optional[ExpertShard] = None) -> Optional[str]:
        """A global megatron name's spelling in `named_params` (on the stage that holds it); None for an expert
        another expert-parallel rank holds. `experts`: whose expert numbering (this rank's by default)."""
        name = (experts or self.experts).local(megatron_name)
        return None if name is None else local_name(name, self.cfg.num_layers, self.layout.pp, self.virtual_pp)

    def stage_entries(self, names=None, experts: Optional[ExpertShard] = None) -> list[tuple[Any, str]]:
        """(bridge entry, local name) of every bridge tensor on this stage, among `names` (`named_params` by
        default) spelled with `experts`' numbering (this rank's by default).

        megatron-core numbers `decoder.layers.N` from 0 on every chunk; the
        bridge and HF checkpoints number layers globally. Which stage and chunk
        holds a tensor is `parallel.stages`' answer, the one the plans use.
        """
        names, out = names if names is not None else self.named_params().keys(), []
        for entry in self.bridge.entries():
            if self.value_head and entry.megatron == "output_layer.weight":
                continue
            if param_stage(entry.megatron, self.cfg.num_layers, self.layout.pp, self.virtual_pp) != self.coord.pp:
                continue
            local = self.local_name(entry.megatron, experts)
            if local in names:  # not a tied output layer at pp = 1 (the embedding's), not another rank's expert
                out.append((entry, local))
        return out

    def _tied_output_copy(self) -> bool:
        """The last stage's copy of a tied embedding (pp > 1): loaded from the embedding, never exported."""
        return (self.cfg.tie_word_embeddings and not self.value_head and self.layout.pp > 1
                and self.local_name("output_layer.weight") in self.named_params())

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
        params = self.named_params()
        tp_rank, tp = self.coord.tp, self.layout.tp
        self.bridge.check_hf_names(read.keys())
        for entry, local in self.stage_entries():
            params[local].copy_(self.bridge.read_shard(entry, read, tp_rank, tp))
        if self._tied_output_copy():
            embedding = next(e for e in self.bridge.entries() if e.megatron == "embedding.word_embeddings.weight")
            params[self.local_name("output_layer.weight")].copy_(self.bridge.read_shard(embedding, read, tp_rank, tp))
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def stage_state(self, traffic: Optional[TrafficCounter] = None) -> dict[str, Tensor]:
        """This stage's tensors, gathered over TP, under global megatron names (each its own copy); with LoRA
        the merged W + s * B A (what an export writes)."""
        from megatron.core import parallel_state as ps

        params, out = self.named_params(), {}
        params = self.lora.merged(params) if self.lora is not None else params
        for entry, local in self.stage_entries():
            tensor = params[local].detach()
            if self.layout.tp > 1 and entry.shard.dim is not None:
                pieces = [torch.empty_like(tensor) for _ in range(self.layout.tp)]
                dist.all_gather(pieces, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
                if traffic is not None:
                    moved = tensor.numel() * tensor.element_size() * (self.layout.tp - 1)
                    traffic.add(moved, moved)  # an all-gather: as much out to the peers as in from them
                out[entry.megatron] = unshard_tensor(pieces, entry.shard)  # joined anew: a copy already
            else:
                out[entry.megatron] = tensor.clone()
        return {**out, **self.exchanged_experts(out, traffic)}  # ep > 1

    def exchanged_experts(self, own: dict[str, Tensor], traffic: Optional[TrafficCounter] = None
                          ) -> dict[str, Tensor]:
        """The other expert-parallel ranks' copies of this rank's expert tensors in `own` (global names); {} at
        ep = 1 (`experts.exchange_experts`, a collective over the expert-parallel group)."""
        return exchange_experts(own, self.experts, expert_group(self.experts.ep), traffic)

    def full_state(self, traffic: Optional[TrafficCounter] = None) -> dict[str, Tensor]:
        """The whole model on every rank (global megatron names): TP all-gathers, then one broadcast
        per pipeline stage over the pipeline group; `traffic` counts what this rank received.

        This is the plain full gather (DeepSpeed-Chat style), one collective per
        tensor: the baseline the 3D-HybridEngine's grouped gather replaces.
        """
        full: dict[str, Tensor] = {}
        for part in self.each_stage(self.stage_state(traffic), traffic):
            full.update(part)
        return full

    def each_stage(self, mine: dict[str, Tensor], traffic: Optional[TrafficCounter] = None):
        """Every pipeline stage's `mine`, in stage order (a generator every rank of the pipeline runs through).

        Each stage broadcasts its dict over the pipeline group in turn, so a
        rank holds at most its own and one other stage's; `traffic` counts
        every broadcast a rank joins, and the bytes of the ones it receives.
        """
        if self.layout.pp == 1:
            yield mine
            return
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        for stage, src in enumerate(dist.get_process_group_ranks(group)):
            own = stage == self.coord.pp
            box = [to_cpu(mine) if own else None]
            dist.broadcast_object_list(box, src=src, group=group)
            if traffic is not None:
                size = sum(t.numel() * t.element_size() for t in box[0].values())
                if own:  # the root sends its stage to every other stage
                    traffic.add(0, size * (self.layout.pp - 1))
                else:
                    traffic.add(size)
            yield box[0]

    def hf_stage_parts(self):
        """The model in HF names, one pipeline stage at a time (a generator every rank must run through):
        what a streamed export writes as it goes."""
        for part in self.each_stage(self.stage_state()):
            yield self.bridge.megatron_to_hf(part, partial=self.layout.pp > 1)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The full model in HF names and layout (gathered over TP, then stage by stage over PP)."""
        if self.value_head:
            raise NotImplementedError("a critic is not an HF causal LM; save it with state_dict()")
        return self.bridge.megatron_to_hf(self.full_state())

    def generation_state(self) -> dict[str, Tensor]:
        """Generation-layout names -> *views* of this rank's parameters (tp = pp = 1: the whole model)."""
        if self.layout.tp > 1 or self.layout.pp > 1 or self.experts.ep > 1:
            raise NotImplementedError("a sharded engine has no whole-model views; gather it (full_state)")
        return self.bridge.megatron_to_generation(self.named_params())

    # -- compute --------------------------------------------------------------
    def _forward_step(self, step_fn: StepFn, packed: bool, share_prompts: bool, scale: float, data_iterator,
                      model):
        batch, rows = next(data_iterator)
        idx = left_align_index(batch[F.ATTENTION_MASK])
        ids = batch[F.INPUT_IDS].gather(1, idx).to(self.torch_device)
        s = ids.shape[1]
        split = self._sequence_split
        if packed:  # the micro-batch's sequences back to back in one row: no padding token is computed
            lengths = batch[F.ATTENTION_MASK].sum(-1).to(ids.device)
            packed_ids, positions, mask = pack_rows(ids, lengths)
            n = packed_ids.shape[1]
            self.routes.begin(batch, rows, lambda: input_tags(batch, idx, split, lengths=lengths), split)
            inputs = pad_columns(packed_ids, positions, mask, split)
            output = forward_with_padding(model, inputs, lengths.sum()[None], self.tconfig)[:, :n]
            output = unpack_sequences(output, lengths, s)
        elif share_prompts:  # each distinct prompt computed once, its rows' responses after it
            mask = batch[F.ATTENTION_MASK].to(ids.device)
            prompt_width = s - batch[F.RESPONSES].shape[1]
            shared_ids, positions, shared_mask, index = share_prompt_rows(
                ids, mask.sum(-1), mask[:, :prompt_width].sum(-1))
            n, real = shared_ids.shape[1], shared_lengths(index, *shared_ids.shape)
            shared = (index, *shared_ids.shape)
            self.routes.begin(batch, rows, lambda: input_tags(batch, idx, split, shared=shared), split)
            shared_ids, positions, shared_mask = pad_columns(shared_ids, positions, shared_mask, split)
            with self.rope.at(positions):
                output = forward_with_padding(model, (shared_ids, positions, shared_mask), real, self.tconfig)
            output = unshare_rows(output[:, :n], index)
        elif self.layout.cp > 1:
            cp = (self.layout.cp, self.coord.cp, self._pipeline_width(s))
            self.routes.begin(batch, rows, lambda: input_tags(batch, idx, cp=cp), split)
            output = context_parallel_forward(model, ids, self.layout.cp, self.coord.cp, self._pipeline_width(s),
                                              batch[F.ATTENTION_MASK].sum(-1), self.tconfig)
        else:
            positions = torch.arange(s, device=ids.device)[None].expand_as(ids)
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), 1)[None, None]
            # At pp > 1 the output is this stage's activations, so the padding is cut in `_loss`.
            self.routes.begin(batch, rows, lambda: input_tags(batch, idx, split), split)
            output = forward_with_padding(model, pad_columns(ids, positions, causal, split),
                                          batch[F.ATTENTION_MASK].sum(-1), self.tconfig)
        self.routes.end()
        return output, functools.partial(self._loss, step_fn, batch, idx, rows, scale)

    def _pipeline_width(self, s: int) -> int:
        """The row width the forward pass runs at, from which megatron-core's schedule sizes the activations
        its stages send (it divides by cp, and by tp under sequence parallelism, itself)."""
        multiple = self._sequence_split * (2 * self.layout.cp if self.layout.cp > 1 else 1)
        return padded_width(s, multiple)

    @property
    def _sequence_split(self) -> int:
        """What every row's width must be a multiple of: tp under sequence parallelism (each TP rank holds
        an equal slice of the sequence between the TP regions), else 1."""
        return self.layout.tp if self.tconfig.sequence_parallel else 1

    @staticmethod
    def _loss(step_fn: StepFn, batch: dict[str, Any], idx: Tensor, rows: int, scale: float, output: Tensor):
        if rows == 0:  # a micro-batch only the interleaved schedule's grouping added
            return output.sum() * 0.0, None
        output = unalign(output[:, :idx.shape[1]], idx.to(output.device))  # less any columns `pad_columns` added
        # The micro-batch arrives as the controller sent it (CPU); the loss is computed where the model ran.
        batch = {k: v.to(output.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        if output.shape[-1] == 1:
            output = output.squeeze(-1)
        if rows < len(output):  # rows added only to give every pipeline micro-batch one shape
            output, batch = output[:rows], slice_rows(batch, 0, rows)
        loss, report = step_fn(output, batch)
        return (loss if scale == 1 else loss * scale), report

    def run(self, micro_batches: list[dict[str, Any]], step_fn: StepFn,
            forward_only: bool = False, packed: bool = False,
            share_prompts: bool = False) -> list[dict[str, Any]]:
        """Forward (and backward) over micro-batches; returns what each step_fn reported, on every rank.

        Each micro-batch holds at least INPUT_IDS and ATTENTION_MASK [b, S] (`data.fields`); step_fn
        sees the output [b, S, ...] of its real rows and columns only, whatever padding the layout adds
        (empty rows to one shape at pp > 1, right columns to a multiple of tp under sequence
        parallelism, empty micro-batches to a multiple of pp at virtual_pp > 1, whose real losses are
        then scaled so the gradient is unchanged). Megatron divides each loss by len(micro_batches),
        so step_fn returns its micro-batch's share of the mini-batch loss times len(micro_batches).
        packed=True runs each micro-batch as one row of its real tokens (`pack_rows`);
        share_prompts=True runs the rows that share a prompt as one row, the prompt once
        (`share_prompt_rows`; needs RESPONSES); both need pp = 1, cp = 1 and full attention
        (ValueError otherwise). At cp > 1 every CP rank sees the whole output, gathered. Reports,
        computed on the last pipeline stage, are broadcast to the others. RuntimeError on a frozen
        engine unless forward_only.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not forward_only and self.optimizer is None:
            raise RuntimeError("this engine is frozen (built without an optimizer)")
        windowed = any(w is not None for w in self.cfg.layer_windows)
        if packed and (self.layout.pp > 1 or self.layout.cp > 1 or windowed):
            raise ValueError("packed micro-batches need pp = 1, cp = 1 and full attention in every layer")
        if share_prompts and (packed or self.layout.pp > 1 or self.layout.cp > 1 or windowed):
            raise ValueError("shared-prompt micro-batches need pp = 1, cp = 1, full attention in every layer "
                             "and no token packing")
        rows = [len(mb[F.INPUT_IDS]) for mb in micro_batches]
        size = max(rows)
        data = [(pad_with_empty_rows(mb, size) if self.layout.pp > 1 else mb, n) for mb, n in zip(micro_batches, rows)]
        real = len(data)
        if self.virtual_pp > 1:
            # The interleaved schedule runs micro-batches in groups of pp: pad with empty ones (no row is
            # real, so step_fn never sees them) and scale the real losses so the gradient stays the sum
            # of step_fn's losses / len(micro_batches).
            data += [(pad_with_empty_rows(slice_rows(micro_batches[0], 0, 0), size), 0)] * (-real % self.layout.pp)
        scale = len(data) / real
        self.routes.reset()
        for model in self.models:
            model.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            reports = get_forward_backward_func()(
                forward_step_func=functools.partial(self._forward_step, step_fn, packed, share_prompts, scale),
                data_iterator=[iter(data) for _ in self.models] if self.virtual_pp > 1 else iter(data),
                model=self.models, num_microbatches=len(data),
                seq_length=self._pipeline_width(data[0][0][F.INPUT_IDS].shape[1]),
                micro_batch_size=data[0][0][F.INPUT_IDS].shape[0], forward_only=forward_only)
        reports = reports[:real]  # the padding micro-batches come last and report nothing
        return self._from_last_stage(to_cpu(reports))  # reports leave the engine as CPU tensors, like batches

    def _from_last_stage(self, reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.layout.pp == 1:
            return reports
        from megatron.core import parallel_state as ps

        last = ps.is_pipeline_last_stage()
        box = [reports if last else None]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return reports if last else box[0]

    def zero_grad(self) -> None:
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> StepStats:
        """Apply accumulated gradients (clip, Adam, LR schedule)."""
        _, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        return StepStats(grad_norm=float("nan") if grad_norm is None else float(grad_norm), lr=lr,
                         router=self.router_stats.read())

    # -- checkpoints (this rank's shard) --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        params = trainable(self.named_params(), self.lora)  # with LoRA the adapters only
        state: dict[str, Any] = {"model": {k: v.detach().clone() for k, v in params.items()}}
        if self.optimizer is not None and self._has_stepped():
            state["optimizer"] = self.optimizer.state_dict()
            state["optimizer_params"] = [optimizer_param_state(opt) for opt in self.optimizer.chained_optimizers]
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _has_stepped(self) -> bool:
        """Adam state exists only after the first step (Megatron cannot save it before)."""
        return any(len(opt.optimizer.state) for opt in self.optimizer.chained_optimizers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self._check_optimizer_kind(state)
        params = self.named_params()
        want = set(trainable(params, self.lora))
        if set(state["model"]) != want:  # another layout's shard: e.g. other experts (parallel.ep), or no adapters
            missing, unknown = sorted(want - set(state["model"])), sorted(set(state["model"]) - want)
            raise ValueError(f"this checkpoint shard does not hold this rank's tensors (written at another layout, "
                             f"e.g. another parallel.ep?): missing {missing[:3]}, unknown {unknown[:3]}")
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
        c = self.coord
        return Path(directory) / shard_file(c.tp, c.pp, c.dp, c.cp)

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

