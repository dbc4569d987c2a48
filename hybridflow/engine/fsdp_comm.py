"""FSDP2's all-gather of a unit, holding the gathered weights once instead of two or three times.

FSDP2 gathers a unit in two steps: an all-gather into one flat output buffer (rank r's chunks of every
parameter at slice r), then a copy out of it into each parameter's own unsharded tensor. Under gloo a unit
is then held at least twice: gloo's `all_gather_into_tensor` goes through a staging copy of the output, and
the output buffer is alive while the copy-out fills the parameters; in a forward FSDP keeps the buffer until
the next unit's all-gather has run (to overlap the two on a GPU), so that one adds the previous unit's
(`hybridflow bench fsdp` measures it). `InPlaceAllGather`, set on a unit with
`FSDPModule.set_custom_all_gather` (torch's hook for custom collectives), removes both:

- on gloo it fills the output in place, one `broadcast` per rank of that rank's slice (gloo broadcasts in
  the tensor itself: no staging); other backends keep `all_gather_into_tensor` (the engines set this
  all-gather on gloo meshes only, `gather_in_place`);
- for a unit of one parameter sharded on dim 0 (a linear layer without bias, an embedding) the flat output
  has exactly the layout of the parameter's unsharded tensor (rank r's padded chunk at slice r), so
  `allocate` hands FSDP that tensor's own storage: the copy-out copies each element onto itself and the
  buffer is freed with the parameter when the unit reshards.

The second reads FSDP2's per-parameter state (`FSDPParam.all_gather_outputs`, the tensor its copy-out
fills), which is not public API: `fits_in_place` checks the layout it relies on and anything else gets a
plain buffer, and tests/engine/test_fsdp_comm.py compares the gathered weights with the default all-gather's
and checks that a single-parameter unit's buffer is its parameter's storage.

`chunk_rows` and `chunk_bounds` say which dim-0 rows of a tensor FSDP2 gives each rank.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather


class InPlaceAllGather(AllGather):
    """The all-gather of one FSDP unit (an `FSDPModule`): see the module doc."""

    def __init__(self, unit: nn.Module):
        groups = unit._get_fsdp_state()._fsdp_param_groups
        self.params = groups[0].fsdp_params if len(groups) == 1 else []

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The flat output: the single parameter's unsharded tensor where it has the output's layout."""
        if len(self.params) == 1 and fits_in_place(self.params[0], size, dtype, device):
            param = self.params[0]
            # FSDP's copy-out makes this tensor on the first gather; made here, the first gather too is in place
            param.init_all_gather_outputs([size[0] // param.mesh_info.shard_mesh_size], [dtype],
                                          param.mesh_info.shard_mesh_size, device)
            out = param.all_gather_outputs[0]
            if out.dtype == dtype and out.shape == torch.Size(size):
                param.alloc_all_gather_outputs()  # its storage (freed when the unit resharded)
                # The same memory as a tensor of its own, not a view: FSDP's copy-in and the all-gather write
                # into it, and a view would bump the parameter's version counter, which autograd checks on
                # the weights a forward saved for the backward (FSDP's own copy-out preserves it too).
                return torch.empty(0, dtype=dtype, device=device).set_(out.untyped_storage(), 0, out.shape)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        if dist.get_backend(group) != "gloo":
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        n = input_tensor.numel()  # FSDP copied this rank's input to its slice of the output already
        for rank in range(group.size()):
            dist.broadcast(output_tensor.narrow(0, rank * n, n), group_src=rank, group=group)
        return None  # done (synchronously): FSDP then waits on nothing


def fits_in_place(param, size: Sequence[int], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the flat all-gather output of `param` alone is laid out as its unsharded tensor: sharded on
    dim 0, gathered as one tensor of its own dtype (no all-gather extension such as float8's)."""
    return (param.fsdp_placement.dim == 0 and len(size) == 1 and dtype != torch.uint8
            and not hasattr(param._sharded_local_tensor, "fsdp_pre_all_gather")
            and (param.param_dtype or param.orig_dtype) == dtype and torch.device(device) == param.device)


def gather_in_place(units: Sequence[nn.Module], mesh) -> None:
    """Give each FSDP unit of `units` (sharded over `mesh`) its `InPlaceAllGather`, on gloo only: that is
    where it is tested (CPU). On NCCL FSDP2's own all-gather has no staging copy, and the
    in-place buffer, which reads FSDP2's private state, has not run on a GPU: those units keep the default."""
    if dist.get_backend(mesh.get_group()) != "gloo":
        return
    for unit in units:
        unit.set_custom_all_gather(InPlaceAllGather(unit))


def chunk_rows(rows: int, ranks: int) -> int:
    """FSDP2's dim-0 chunk size of a tensor of `rows` rows over `ranks` (torch.chunk's: every chunk but the
    last ones this many rows; those may be short or empty)."""
    return -(-rows // ranks)


def chunk_bounds(param) -> tuple[int, int]:
    """The whole tensor's dim-0 rows [start, stop) this rank holds of a DTensor FSDP2 sharded."""
    mesh = param.device_mesh
    start = min(mesh.get_local_rank() * chunk_rows(param.shape[0], mesh.size()), param.shape[0])
    return start, start + param.to_local().shape[0]
