"""The generation weights of an actor under FSDP2 (`engine/fsdp.py`): the whole model on every rank (tg = 1).

Each rank holds dim-0 chunk `rank` of every tensor. The switch to generation
all-gathers them into a plain `Decoder` per rank, in buckets: the bucket's
chunks (cast to the generation dtype first, so a float32 master copy under
mixed precision moves at the compute dtype's size) are concatenated, padded to
FSDP's even chunk size, gathered in one collective, and cut back into whole
tensors. Per rank that is, by the plan, `(N - 1) / N` of the model received
(plus each tensor's padding rows; `plan_bytes`), and the rank's own chunks sent
to each of the N - 1 others; the counter adds what each collective moved, so
the test compares the two. Switching back frees the generation model (and a
forward pass on freed weights raises), so training holds only its shard.

An engine on a `transformers` model (`engine/fsdp_hf.py`) holds HF tensors: each
is gathered the same way, and the bridge fuses q/k/v and gate/up into the
decoder's tensors as their last part arrives (`LlamaBridge.fuse_stream`); for a
model hybridflow's decoder does not build, the generator is the model's own
class (`hf_generation_model`) and takes the gathered tensors as they are. Each
refresh fills every generator tensor (checked when it is built).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.engine.fsdp_comm import chunk_rows
from hybridflow.engine.fsdp_frozen import init_buffers
from hybridflow.engine.fsdp_hf import without_dropout
from hybridflow.hybrid_engine.generation import transition_metrics
from hybridflow.hybrid_engine.reshard import DEFAULT_BUCKET_BYTES, refuse_released
from hybridflow.hybrid_engine.traffic import Traffic
from hybridflow.models.bridge import get_bridge
from hybridflow.models.decoder import Decoder, rope_inv_freq


def hf_generation_model(config, dtype: torch.dtype, device: torch.device):
    """An HF *ForCausalLM of `config` for generation: allocated, not initialised (every weight is filled by
    the first refresh), its rotary buffers computed; eval mode, no gradients."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(without_dropout(config), dtype=dtype,
                                                              attn_implementation="sdpa")
    model.to_empty(device=device)  # allocates each module's tensors apart: a tied output layer is untied
    model.tie_weights()
    init_buffers(model)
    return model.eval()


def _row_size(shape) -> int:
    """Elements per dim-0 row of a tensor of `shape`."""
    return int(torch.Size(shape[1:]).numel())


def plan_bytes(shapes: dict[str, tuple[int, ...]], ranks: int, element: int) -> int:
    """Bytes one rank receives gathering tensors of `shapes` from `ranks` even dim-0 chunks: N - 1 chunks,
    each padded to the chunk size, per tensor."""
    return element * sum(chunk_rows(s[0], ranks) * _row_size(s) * (ranks - 1) for s in shapes.values())


class FSDPGatheredWeights:
    """A whole-model generator per rank, refilled from an `FSDPEngine`'s shards by bucketed all-gathers."""

    def __init__(self, engine, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.engine, self.bucket_bytes = engine, bucket_bytes
        self.ranks = engine.layout.dp
        self.mesh = (engine.rank, self.ranks, True)  # every rank generates its own share of the prompts
        # The engine's tensors in its generation layout: the decoder's own names, or (an HF `transformers`
        # model, engine/fsdp_hf.py) HF names, whose q/k/v and gate/up the bridge fuses into the decoder's.
        self.params = engine._generation_params()  # name -> DTensor
        self.shapes = {name: tuple(p.shape) for name, p in self.params.items()}
        native, hf_names = engine.cfg.native, engine.modeling == "transformers"
        bridge = get_bridge(engine.cfg) if native and hf_names else None
        # (`transformers` fuses an MoE layer's experts in memory: the engine names them as its checkpoint does)
        self.fuse = (lambda named: bridge.fuse_stream(engine.to_checkpoint_names(named))) if bridge else None
        if native:
            model = Decoder(engine.cfg).to(device=engine.torch_device, dtype=engine.dtype).eval()
            model.inv_freq = rope_inv_freq(engine.cfg).to(engine.torch_device)
        else:  # a model only transformers builds generates on its own code (rollout/hf_generate.py)
            model = hf_generation_model(engine.hf_config, engine.dtype, engine.torch_device)
        self.model = model
        self.model.requires_grad_(False)
        self.model_shapes = {name: p.shape for name, p in self.model.named_parameters()}
        # Every generation tensor is refilled by each refresh (a tensor left out would generate from whatever
        # memory it was given, or from stale weights): the gathered names, fused where the bridge fuses.
        filled = {e.generation for e in bridge.entries()} if bridge is not None else set(self.params)
        if filled != set(self.model_shapes):
            raise RuntimeError(f"the generator's tensors {sorted(set(self.model_shapes) ^ filled)[:4]} are not "
                               f"the engine's gathered ones")
        self.element = torch.empty((), dtype=engine.dtype).element_size()
        self._released = None
        self.refresh()

    def plan_bytes(self) -> int:
        return plan_bytes(self.shapes, self.ranks, self.element)

    def release(self) -> None:
        """Free the generation weights until the next `refresh` (a forward pass on them raises)."""
        if self._released is not None:
            return
        for p in self.model.parameters():
            p.data = p.data.new_empty(0)
        self._released = self.model.register_forward_pre_hook(refuse_released)
        self.model.forward_cached = refuse_released

    def _buckets(self) -> list[list[str]]:
        buckets, size = [[]], 0
        for name, shape in self.shapes.items():
            nbytes = chunk_rows(shape[0], self.ranks) * _row_size(shape) * self.element
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += nbytes
        return [b for b in buckets if b]

    def _padded_chunk(self, name: str) -> Tensor:
        """This rank's chunk of tensor `name`, flat, at the generation dtype, padded to the even chunk size."""
        flat = self.params[name].to_local().detach().to(self.engine.dtype).reshape(-1)
        shape = self.shapes[name]
        want = chunk_rows(shape[0], self.ranks) * _row_size(shape)
        return torch.cat([flat, flat.new_zeros(want - flat.numel())]) if flat.numel() < want else flat

    def _gathered(self, traffic: Traffic):
        """(name, whole tensor) of each of the engine's tensors, gathered bucket by bucket."""
        for bucket in self._buckets():
            chunks = [self._padded_chunk(name) for name in bucket]
            flat = torch.cat(chunks)
            if self.ranks > 1:
                pieces = [torch.empty_like(flat) for _ in range(self.ranks)]
                dist.all_gather(pieces, flat, group=self.engine.group)
                moved = flat.numel() * flat.element_size() * (self.ranks - 1)
                traffic.add(moved, moved)  # N - 1 peers' buckets in, the own out to each
            else:
                pieces = [flat]
            offset = 0
            for name, chunk in zip(bucket, chunks):
                shape, count = self.shapes[name], chunk.numel()
                rows = chunk_rows(shape[0], self.ranks)
                yield name, torch.cat([p[offset:offset + count].view(rows, *shape[1:]) for p in pieces])[:shape[0]]
                offset += count

    @torch.no_grad()
    def refresh(self) -> dict[str, float]:
        """Gather the engine's current shards into the generation model; the transition's figures."""
        start, traffic = time.perf_counter(), Traffic()
        params = dict(self.model.named_parameters())
        if self._released is not None:
            for name, p in params.items():
                p.data = p.data.new_empty(self.model_shapes[name])
            self._released.remove()
            del self.model.forward_cached
            self._released = None
        gathered = self._gathered(traffic)
        for name, whole in (self.fuse(gathered) if self.fuse is not None else gathered):
            params[name].copy_(whole)
        metrics = transition_metrics(traffic, self.model, time.perf_counter() - start)
        metrics["reshard/own_shard_bytes"] = float(sum(p.to_local().numel() * p.to_local().element_size()
                                                       for p in self.engine.named_params().values()))
        metrics["reshard/plan_bytes"] = float(self.plan_bytes())
        return metrics
