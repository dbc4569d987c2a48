"""The FSDP2 engine: hybridflow's decoder sharded by `torch.distributed.fsdp.fully_shard`.

Beside `MegatronEngine`, behind the interface the roles already call (`run`,
`zero_grad`, `step`, `save`/`load`, `layout`, `fused_output`; `roles/batching.py`),
for what users of verl or NeMo-RL pick FSDP for: an HF checkpoint trained with
no megatron-core layout, and frozen models (reference, reward) that cost each
rank 1/N of their size instead of all of it.

The model is `models.decoder.Decoder` (the Llama / Qwen2 / Mistral family, in
megatron's fused qkv / [gate; up] layout, so the bridge's names and the
3D-HybridEngine's generation model are the same tensors). Every linear layer,
every block, the embedding and output layer, then the root are `fully_shard`ed
(`engine_units`) over a one-dimensional device mesh of the group's world: each
rank holds dim-0 chunk `rank` of every parameter; a unit's parameters are
all-gathered just before its forward (and backward) and freed after it, into
the parameters themselves (`fsdp_comm.InPlaceAllGather`), so a frozen rank's
peak is its shard plus the largest unit (the output layer) gathered once.
Gradients are reduce-scattered (averaged over the mesh, as Megatron DDP
averages over dp).

Every rank of the mesh must run the same number of forward (and backward)
passes, since each one all-gathers: `run` agrees the largest micro-batch count
over the mesh, and a rank with fewer runs an idle one-token pass whose gradient
is zero.

Numbers are megatron-core's: the loss is divided by the micro-batch count, Adam
(torch's AdamW) decays every parameter but biases and 1-D ones, the gradient is
clipped by its global norm, the LR follows megatron-core's scheduler. The same
GRPO or PPO run agrees with `MegatronEngine` to float32 rounding
(tests/engine/test_fsdp_engine.py, tests/trainer/test_fsdp_roles.py).
Checkpoints are torch DCP (each rank writes its shards; `hybridflow reshard`
converts them to HF), exports are HF safetensors. With `lora`, `peft` adapters
train on the frozen base (`fsdp_lora.py`): checkpoints hold the adapters and
their Adam state, generation and the export the merged weights.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.checkpoint.format import FSDP_STATE
from hybridflow.data import fields as F
from hybridflow.config.schema import LoRAConfig
from hybridflow.engine.build import lr_scheduler
from hybridflow.engine.fsdp_comm import chunk_bounds, chunk_rows, gather_in_place
from hybridflow.engine.fsdp_lora import PeftLoRA, adapter_state, attach, base_named
from hybridflow.engine.megatron import StepFn, StepStats
from hybridflow.engine.packing import (left_align_index, pack_rows, share_prompt_rows, to_cpu, unalign,
                                       unpack_sequences, unshare_rows)
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import resolve_dtype
from hybridflow.models.config import DecoderConfig
from hybridflow.models.decoder import Decoder, rope_inv_freq
from hybridflow.parallel.layout import Coord, ParallelDims
from hybridflow.parallel.process_group import init_process_group, keeps_world_state

# beside the DCP shards: what DCP does not hold (the LR schedule, the world)
STATE_FILE = FSDP_STATE


class LanguageModel(nn.Module):
    """The decoder and its vocabulary output: (ids, positions, allowed mask) -> logits [b, s, vocab]."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.decoder = Decoder(cfg)

    def forward(self, ids: Tensor, attention_mask: Optional[Tensor], positions: Optional[Tensor],
                allowed: Optional[Tensor]) -> Tensor:
        return self.decoder(ids, attention_mask, positions, allowed)


class ValueModel(nn.Module):
    """The decoder with a scalar head in place of the vocabulary (the critic): -> values [b, s, 1].

    The head starts at zero, as megatron's (`engine.build.ValueHead`), so both engines' critics start
    from the same function of an HF checkpoint (which has no value head)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.decoder = Decoder(cfg)
        self.decoder.lm_head = None  # never applied: the head below replaces it
        self.head = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, ids: Tensor, attention_mask: Optional[Tensor], positions: Optional[Tensor],
                allowed: Optional[Tensor]) -> Tensor:
        return self.head(self.decoder.hidden_states(ids, attention_mask, positions, allowed))


def block_units(block: nn.Module) -> list[nn.Module]:
    """A decoder block's FSDP units, children first: each of its linear layers, then the block (its norms)."""
    return [m for m in block.modules() if isinstance(m, nn.Linear)] + [block]


def engine_units(decoder: Decoder, value_head: bool) -> list[nn.Module]:
    """The submodules `FSDPEngine` shards as units of their own, children first: every linear layer of each
    block, then the block (its norms); the embedding and the output layer when they are not one tied tensor
    (tied, the one tensor is used first and last, so it stays in the root, with the final norm and the value
    head). A unit is gathered whole only while it runs, so the largest (the output layer or the embedding)
    bounds what a frozen model holds above its shard: 1/N of the model plus one unit (`hybridflow bench
    fsdp`). Single-tensor units are also what `fsdp_comm.InPlaceAllGather` gathers in place."""
    units = [unit for block in decoder.layers for unit in block_units(block)]
    if decoder.lm_head is not None:  # untied: the embedding and the output layer, each its own unit
        units += [decoder.embed, decoder.lm_head]
    elif value_head:  # the value model's decoder has no output layer: the embedding alone
        units.append(decoder.embed)
    return units


def _no_weight_decay(name: str, param: Tensor) -> bool:
    """megatron-core's default: biases and 1-D parameters (norms) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


class FSDPEngine:
    """This rank's shard of a decoder under FSDP2, and its optimizer (None: frozen, forward only).

    value_head=True: the critic's scalar head. dtype: the compute dtype; below float32 the parameters
    and optimizer stay float32 and FSDP casts each block's gathered weights (mixed precision, as
    megatron's bf16 with float32 main parameters). offload=True keeps parameters, gradients and Adam
    state in CPU memory between uses (`CPUOffloadPolicy`; a CUDA device only, where it saves device
    memory). `self.layout` is dp = the world (tp = pp = cp = 1); the output layer is never fused.
    lora (rank > 0): `peft` adapters on the targeted linears, the base frozen (`self.lora`, `fsdp_lora.py`).
    """

    kind = "fsdp"
    modeling = "hybridflow"  # whose model code runs (`<role>.fsdp.modeling`)

    def __init__(self, model_cfg: DecoderConfig, optim=None, *, device: str = "cpu", dtype: str = "float32",
                 make_vocab_size_divisible_by: int = 128, value_head: bool = False, total_steps: int = 1,
                 seed: int = 0, offload: bool = False, lora: Optional[LoRAConfig] = None):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if offload and device == "cpu":
            raise ValueError("FSDP offload moves parameters and optimizer state from a GPU to the CPU; "
                             "on the CPU they are there already")
        self.cfg, self.device, self.value_head = model_cfg, device, value_head
        self.dtype = resolve_dtype(dtype)
        self.fused_output = False
        self.optim_cfg = optim
        # (none for a model only transformers builds: fsdp_hf.TransformersFSDPEngine uses HF names throughout)
        self.bridge = get_bridge(model_cfg, make_vocab_size_divisible_by, 1) if model_cfg.native else None
        self.mesh = world_mesh(device)
        world, self.rank = dist.get_world_size(), dist.get_rank()
        self.layout = ParallelDims(dp=world)
        self.coord: Coord = self.layout.coord(self.rank)
        self.group = self.mesh.get_group()
        with torch.device("meta"):
            self.module: nn.Module = self._meta_module()
            self.lora: Optional[PeftLoRA] = (attach(self.module, lora, self.modeling == "hybridflow")
                                             if lora is not None and lora.rank > 0 else None)
        mixed = (MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
                 if self.dtype != torch.float32 else MixedPrecisionPolicy())
        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        units = self._units()
        for unit in units:
            fully_shard(unit, mesh=self.mesh, mp_policy=mixed, offload_policy=policy)
        # Left to itself FSDP keeps the root's weights whole after a forward, for the backward; a frozen
        # engine has none, so it frees them.
        fully_shard(self.module, mesh=self.mesh, mp_policy=mixed, offload_policy=policy,
                    reshard_after_forward=True if optim is None else None)
        gather_in_place([*units, self.module], self.mesh)  # each unit gathered once (engine/fsdp_comm.py)
        self.module.to_empty(device="cpu" if offload else self.torch_device)
        self._init_buffers()
        if self.lora is not None:
            self.lora.init(seed)
        if value_head:
            with torch.no_grad():
                self.module.head.weight.zero_()
        self.optimizer = self.scheduler = None
        if optim is not None:
            self._build_optimizer(optim, total_steps)
        else:
            self.module.requires_grad_(False)
            self.module.eval()

    # -- the model: hybridflow's decoder (`fsdp_hf.TransformersFSDPEngine`: an HF transformers model) --
    def _meta_module(self) -> nn.Module:
        """The model to shard, built on the meta device (no memory): (ids, attention mask, positions, allowed
        mask) -> logits, or values under a value head."""
        return ValueModel(self.cfg) if self.value_head else LanguageModel(self.cfg)

    def _units(self) -> list[nn.Module]:
        """The submodules sharded as units of their own, children first (the root is sharded after them)."""
        return engine_units(self.module.decoder, self.value_head)

    def _init_buffers(self) -> None:
        """What `to_empty` left uninitialised and no checkpoint holds: the rotary frequencies."""
        self.module.decoder.inv_freq = rope_inv_freq(self.cfg).to(self.torch_device)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.device == "cpu" else torch.device("cuda", torch.cuda.current_device())

    @property
    def data_parallel_group(self):
        """The group a mini-batch's rows are split over (and its loss and metrics summed over)."""
        return self.group

    @property
    def tensor_parallel_group(self):
        return None

    @property
    def output_weight(self) -> Optional[Tensor]:
        return None  # the output layer runs inside the model (`fused_output` is False)

    def _build_optimizer(self, optim, total_steps: int) -> None:
        decay, plain = [], []
        for name, param in self.module.named_parameters():
            if param.requires_grad:  # with LoRA the adapters only
                (plain if _no_weight_decay(name, param) else decay).append(param)
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": plain, "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr,
                                           betas=tuple(optim.betas), eps=optim.eps,
                                           weight_decay=optim.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, optim, total_steps)

    # -- weights --------------------------------------------------------------
    def named_params(self) -> dict[str, Tensor]:
        """This rank's parameters (DTensors holding its dim-0 chunk), under the module's names."""
        return dict(self.module.named_parameters())

    def _base_params(self) -> dict[str, Tensor]:
        """Generation-layout name (the bridge's `entry.generation`) -> this rank's DTensor parameter of the base
        model (with LoRA: peft's `.base_layer` weights under the plain names, no adapter)."""
        return {name[len("decoder."):]: p for name, p in base_named(self.module) if name.startswith("decoder.")}

    def _generation_params(self) -> dict[str, Tensor]:
        """`_base_params` as generation reads them: with LoRA an adapted weight is its `fsdp_lora.MergedShard`
        (this rank's chunk of W + s * B A)."""
        params = self._base_params()
        return params if self.lora is None else {n: self.lora.view("decoder." + n, p) for n, p in params.items()}

    def load_hf_checkpoint(self, path: str | Path) -> int:
        """This rank's chunk of every tensor from an HF safetensors checkpoint, reading only the HF rows it
        comes from (`LlamaBridge.read_rows`): no rank reads, or holds, the whole model. Returns the bytes
        read (about 1/N of the checkpoint)."""
        from hybridflow.models.checkpoint import SafetensorsReader

        with SafetensorsReader(path) as read:
            self._load(read, path)
        return read.bytes_read

    def load_hf_state_dict(self, hf: dict[str, Tensor]) -> None:
        """The same from whole HF tensors in memory."""
        from hybridflow.models.checkpoint import TensorsReader

        self._load(TensorsReader(hf), "the HF state dict")

    @torch.no_grad()
    def _load(self, read, source) -> None:
        """Copy this rank's rows of every parameter, as `read` (a `bridge.SliceReader`) gives them."""
        params = self._base_params()
        self.bridge.check_hf_names(read.keys())
        loaded = set()
        for e in self.bridge.entries():
            if self.value_head and e.generation == "lm_head.weight":  # the value model has no output layer
                continue
            param = params[e.generation]
            start, stop = chunk_bounds(param)
            if stop > start:
                param.to_local().copy_(self.bridge.read_rows(e, read, start, stop))
            loaded.add(e.generation)
        if loaded != set(params):
            raise KeyError(f"{source}: no weights for {sorted(set(params) - loaded)} in the bridge's entries")

    def full_generation_state(self) -> dict[str, Tensor]:
        """The whole model under generation names, on every rank (one all-gather per tensor)."""
        return {name: param.full_tensor() for name, param in self._generation_params().items()}

    def hf_state_dict(self) -> dict[str, Tensor]:
        if self.value_head:
            raise NotImplementedError("a critic is not an HF causal LM; save it with save()")
        # Under mixed precision the parameters are float32 masters; the export is at the model's dtype,
        # as its config.json says (megatron's export likewise). Copies: at one rank a DTensor's full tensor is
        # its local one, which the optimizer steps in place.
        return self._generation_to_hf({k: v.to(self.dtype, copy=True)
                                       for k, v in self.full_generation_state().items()})

    def _generation_to_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The generation layout's tensors under HF names: the decoder's, unfused by the bridge."""
        return self.bridge.generation_to_hf(state)

    def hf_stage_parts(self):
        """As `MegatronEngine.hf_stage_parts`: one part, the whole model (every rank gathers)."""
        yield self.hf_state_dict()

    # -- compute --------------------------------------------------------------
    def _forward(self, mb: dict[str, Any], packed: bool, share_prompts: bool) -> Tensor:
        dev = self.torch_device
        ids, mask = mb[F.INPUT_IDS].to(dev), mb[F.ATTENTION_MASK].to(dev)
        if not (packed or share_prompts):  # the decoder takes left padding itself (positions from the mask)
            return self.module(ids, mask, None, None)
        idx = left_align_index(mask)
        aligned = ids.gather(1, idx)
        s, lengths = aligned.shape[1], mask.sum(-1)
        if packed:  # the micro-batch's sequences back to back in one row
            packed_ids, positions, masked = pack_rows(aligned, lengths)
            output = unpack_sequences(self.module(packed_ids, None, positions, ~masked), lengths, s)
        else:  # each distinct prompt once, its rows' responses after it
            prompt_width = s - mb[F.RESPONSES].shape[1]
            shared, positions, masked, index = share_prompt_rows(aligned, lengths, mask[:, :prompt_width].sum(-1))
            output = unshare_rows(self.module(shared, None, positions, ~masked), index)
        return unalign(output, idx)

    def _idle_forward(self) -> Tensor:
        """A one-token pass that takes part in every block's all-gather (and, backward, reduce-scatter)."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.torch_device)
        return self.module(ids, torch.ones_like(ids), None, None)

    def run(self, micro_batches: list[dict[str, Any]], step_fn: StepFn, forward_only: bool = False,
            packed: bool = False, share_prompts: bool = False) -> list[dict[str, Any]]:
        """Forward (and backward) over micro-batches; what each step_fn reported (as `MegatronEngine.run`).

        Each step_fn loss is divided by len(micro_batches) before its backward, as megatron-core's
        schedule does, so the same role code gives the same gradient under either engine. packed /
        share_prompts: as there (full attention only).
        """
        if not forward_only and self.optimizer is None:
            raise RuntimeError("this engine is frozen (built without an optimizer)")
        if (packed or share_prompts) and any(w is not None for w in self.cfg.layer_windows):
            raise ValueError("packed or shared-prompt micro-batches need full attention in every layer")
        n = len(micro_batches)
        total = agreed_count(n, self.group, self.torch_device)
        reports = []
        self.module.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            for i in range(total):
                if i >= n:  # this rank is out of rows; its peers are not
                    out = self._idle_forward()
                    if not forward_only:
                        (out.float().sum() * 0.0).backward()
                    continue
                mb = micro_batches[i]
                output = self._forward(mb, packed, share_prompts)
                if output.shape[-1] == 1:
                    output = output.squeeze(-1)
                batch = {k: v.to(output.device) if isinstance(v, Tensor) else v for k, v in mb.items()}
                loss, report = step_fn(output, batch)
                if not forward_only:
                    (loss / n).backward()
                reports.append(report)
        return to_cpu(reports)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> StepStats:
        """Clip by the global gradient norm, Adam, the LR schedule (megatron-core's order)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if not math.isfinite(norm):  # megatron-core skips such a step too
            self.optimizer.zero_grad(set_to_none=True)
            return StepStats(grad_norm=float("nan"), lr=lr)
        if self.optim_cfg.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.optim_cfg.grad_clip, torch.tensor(norm))
        self.optimizer.step()
        self.scheduler.step(increment=1)
        return StepStats(grad_norm=norm, lr=lr)

    # -- checkpoints (torch DCP: every rank writes its own shards) ------------
    def _has_stepped(self) -> bool:
        return self.optimizer is not None and bool(self.optimizer.state)

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {"model": adapter_state(get_model_state_dict(self.module), self.lora)}
        if self._has_stepped():
            state["optimizer"] = get_optimizer_state_dict(self.module, self.optimizer)
        return state

    def save(self, directory: Path) -> None:
        """This rank's shards of the model (and, once stepped, of Adam's state) into `directory`, torch DCP."""
        import torch.distributed.checkpoint as dcp

        directory = Path(directory)
        dcp.save(self._state(), checkpoint_id=str(directory), process_group=self.group)
        if self.rank == 0:
            meta = {"engine": self.kind, "modeling": self.modeling, "world": self.layout.dp,
                    "value_head": self.value_head,
                    "optimizer": self._has_stepped(),
                    "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
            (directory / STATE_FILE).write_text(json.dumps(meta, indent=1))

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (DCP reshards to any world size; the trainer resumes at the saved one)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        directory = Path(directory)
        meta_path = directory / STATE_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path}: not an FSDP checkpoint (no {STATE_FILE})")
        meta = json.loads(meta_path.read_text())
        saved = meta.get("modeling", "hybridflow")  # written before the key existed: hybridflow's decoder
        if saved != self.modeling:
            raise ValueError(f"{directory} holds a model trained on {saved}'s code (engine.json: modeling), its "
                             f"tensors under that code's names; this engine runs {self.modeling}'s: set the role's "
                             f"fsdp.modeling to {saved}, or convert it with `hybridflow reshard --to hf` and start "
                             f"from that")
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {"model": adapter_state(get_model_state_dict(self.module), self.lora)}
        with_optimizer = self.optimizer is not None and meta["optimizer"]
        if with_optimizer:
            state["optimizer"] = get_optimizer_state_dict(self.module, self.optimizer)
        dcp.load(state, checkpoint_id=str(directory), process_group=self.group)
        set_model_state_dict(self.module, state["model"], options=StateDictOptions(strict=self.lora is None))
        if with_optimizer:
            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
            self.scheduler.load_state_dict(meta["scheduler"])


MESH_STATE = "torch's DTensor caches hold this world's device mesh (an FSDP engine or frozen model ran here)"


def world_mesh(device: str = "cpu"):
    """A one-dimensional device mesh over every rank of the world (gloo on CPU, NCCL on CUDA)."""
    from torch.distributed.device_mesh import init_device_mesh

    init_process_group(device)  # joins the world its launcher set up (idempotent)
    keeps_world_state(MESH_STATE)  # this process then ends with its job (parallel/process_group.py)
    return init_device_mesh("cpu" if device == "cpu" else "cuda", (dist.get_world_size(),),
                            mesh_dim_names=("fsdp",))


def agreed_count(n: int, group, device=None) -> int:
    """The largest `n` over the ranks of `group` (every rank must call it): how many passes each rank runs,
    every pass all-gathering. `device`: where the group's backend takes tensors (a CUDA device under NCCL,
    which has no CPU backend)."""
    if dist.get_world_size(group) == 1:
        return n
    count = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())
