"""`InPlaceAllGather` (engine/fsdp_comm.py) gathers what FSDP2's own all-gather gathers, in the parameter itself.

Run as a script on 2 gloo processes in the suite's 2-process launch (tests/conftest.py, two_process_launch):
one small model sharded twice, once with FSDP2's default all-gather and once with `gather_in_place`, units of
one tensor (a linear layer whose rows do not split evenly over the ranks, an embedding) and of two (a linear
layer with its bias).
Gathering moves weights, it does not compute, so the forward outputs and the gradients are `==` those of the
default and of the unsharded model. A single-tensor unit's weight, while it runs, lies in the buffer the
all-gather filled (no copy of it); a two-tensor unit's does not.
"""
import os
import sys

import torch
from torch import nn



def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 37, bias=False), nn.Linear(37, 5))


def sharded(mesh, in_place: bool):
    from torch.distributed.fsdp import fully_shard

    from hybridflow.engine.fsdp_comm import InPlaceAllGather

    net = model()
    units = list(net)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh)
    buffers = {}
    if in_place:
        for i, unit in enumerate(units):
            comm = InPlaceAllGather(unit)
            allocate = comm.allocate

            def recorded(size, *, dtype, device, i=i, allocate=allocate):
                out = allocate(size, dtype=dtype, device=device)
                buffers[i] = out.data_ptr()
                return out
            comm.allocate = recorded
            unit.set_custom_all_gather(comm)
    return net, buffers


def main(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.parallel import init_process_group

    init_process_group("cpu")
    mesh = init_device_mesh("cpu", (2,))
    ids = torch.tensor([[1, 4, 9, 2], [0, 9, 3, 3]]) + dist.get_rank()
    results = {}
    for in_place in (False, True):
        net, buffers = sharded(mesh, in_place)
        weights_in_buffer = {}
        for i, unit in enumerate(net):
            unit.register_forward_pre_hook(lambda m, a, i=i: weights_in_buffer.__setitem__(
                i, buffers.get(i) == next(m.parameters()).data_ptr()))
        outputs = [net(ids) for _ in range(2)]  # the second on tensors the first freed and made again
        sum(o.square().sum() for o in outputs).backward()
        results[in_place] = {"outputs": outputs, "weights_in_buffer": weights_in_buffer,
                             "grads": [p.grad.full_tensor() for p in net.parameters()]}
    whole = model()
    results["whole"] = [whole(ids) for _ in range(2)]
    if dist.get_rank() == 1:  # the rank whose row chunks are short (37 rows: 19 + 18)
        torch.save(results, out)
    dist.barrier()  # the process group stays for the launch's next script


def test_the_in_place_all_gather_gathers_exactly_and_without_a_copy(two_process_launch):
    got = torch.load(two_process_launch["fsdp_comm"])
    default, in_place = got[False], got[True]
    for a, b, c in zip(in_place["outputs"], default["outputs"], got["whole"]):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(in_place["grads"], default["grads"]):
        assert torch.equal(a, b)
    # embedding and bias-free linear: one tensor each, gathered into itself; the linear with a bias: two
    assert in_place["weights_in_buffer"] == {0: True, 1: True, 2: False}
    assert default["weights_in_buffer"] == {0: False, 1: False, 2: False}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1])
