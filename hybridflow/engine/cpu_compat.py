"""The one place megatron-core is adapted to a CPU-only PyTorch (docs/design.md §4, docs/megatron-on-cpu.md).

megatron-core assumes CUDA in a handful of spots a CPU run reaches:

- literal `device="cuda"` and `torch.cuda.current_device()` for scratch
  tensors and for DDP's contiguous param/grad buffers;
- the CUDA RNG tracker (`get_cuda_rng_tracker().fork()` wraps attention
  dropout even at p=0);
- `param.type() == "torch.cuda.FloatTensor"` checks in the optimizer;
- `tensor.cuda()` on the tied embedding's last-stage copy at pp > 1;
- and, not CUDA assumptions but costs: `torch.compile` wrappers made at
  import for fusions a CPU run never calls (`_eager_fusions`), and without
  apex a gradient clip that scales tensor by tensor through a temporary
  (`_foreach_scale`).

Rather than editing megatron-core, `apply()` gives each loaded
`megatron.core` module a view of `torch` (`_CpuTorch`) whose factory
functions map a CUDA device to the CPU and whose `torch.cuda` answers
`current_device()` with the CPU; installs an RNG tracker holding CPU
generator states; and makes `Tensor.type()` report CPU tensors under their
CUDA names *to megatron-core callers only*. Nothing outside megatron-core
sees a difference. It is applied by the engine only when it runs on CPU in a
process without a visible GPU, and it is idempotent.

Known to work on CPU through this layer: GPTModel (local layer spec),
TP/PP/DP collectives over gloo, Megatron DDP and the distributed optimizer,
and sequence parallelism, whose collectives need nothing here: gloo in torch
2.13 implements the `reduce_scatter_tensor` and `all_gather_into_tensor`
that megatron-core's mappings and linear layers call (what SP needed on CPU
is in the engine: docs/megatron-on-cpu.md). Not supported: Transformer
Engine layers.
"""
from __future__ import annotations

import contextlib
import sys
import types

import torch

_APPLIED = False
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor")


def _on_cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return fn(*args, **kwargs)
    factory.__name__ = fn.__name__
    return factory


class _NoStream:
    """Stands in for CUDA streams: work on CPU is already ordered."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuCuda(types.SimpleNamespace):
    """`torch.cuda` as seen by megatron-core on CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _make_cuda_namespace() -> _CpuCuda:
    nothing = lambda *a, **k: None  # noqa: E731
    return _CpuCuda(
        current_device=lambda: torch.device("cpu"),
        synchronize=nothing, empty_cache=nothing,
        default_stream=lambda *a, **k: _NoStream(), current_stream=lambda *a, **k: _NoStream(),
        Stream=lambda *a, **k: _NoStream(), stream=lambda *a, **k: contextlib.nullcontext(),
        nvtx=types.SimpleNamespace(range_push=nothing, range_pop=nothing),
    )


class _CpuTorch(types.ModuleType):
    """`torch` as seen by megatron-core modules on CPU; everything else passes through."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))
        self.cuda = _make_cuda_namespace()

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups are plain attribute reads
        return value


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's named RNG streams, kept as CPU generator states."""

        def add(self, name, seed):
            if seed in self.seeds_ or name in self.states_:
                raise Exception(f"rng state {name} / seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _patch_tensor_type() -> None:
    """`t.type()` says `torch.cuda.FloatTensor` for a CPU float tensor, to megatron callers only."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return name.replace("torch.", "torch.cuda.", 1) if caller.startswith("megatron.") else name

    torch.Tensor.type = type_


def _patch_tensor_cuda() -> None:
    """`t.cuda()` keeps a CPU tensor where it is, for megatron callers only.

    GPTModel at pp > 1 with tied embeddings moves the last stage's copy of the
    embedding with `.data.cuda()` before all-reducing it with the first stage.
    """
    original = torch.Tensor.cuda

    def cuda(self, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return self if caller.startswith("megatron.") else original(self, *args, **kwargs)

    torch.Tensor.cuda = cuda


@contextlib.contextmanager
def _eager_fusions():
    """While megatron-core is first imported, `torch.compile(fn)` returns `fn` itself.

    megatron-core wraps its fused elementwise functions (bias-GeLU, SwiGLU,
    bias-dropout-add, ...) in `torch.compile` as its modules load. On CPU the
    engine never calls them (their fusions are off in `transformer_config`),
    yet creating the 38 wrappers imports dynamo and inductor, seconds of
    every process's start. Were one called, it would run eagerly: the same
    math, unfused.
    """
    if "megatron.core" in sys.modules:  # imported already: nothing left to spare
        yield
        return
    original = torch.compile

    def eager(model=None, **_options):
        return model if model is not None else (lambda fn: fn)

    torch.compile = eager
    try:
        yield
    finally:
        torch.compile = original


def _megatron_modules():
    # Import what the engine uses first, so every module that holds `torch` is patched.
    with _eager_fusions():
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.transformer.moe.moe_layer  # noqa: F401
        import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
        # dist_checkpointing's save and load (the reshard tool) call torch.cuda for a device and a sync.
        import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
        import megatron.core.dist_checkpointing.strategies.state_dict_saver  # noqa: F401
        import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    return [m for n, m in list(sys.modules.items()) if n.startswith("megatron.") and m is not None]


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """apex's multi_tensor_scale (dst = src * scale over two tensor lists) as one foreach op.

    Without apex megatron-core falls back to `dst.copy_(src * scale)` per tensor, which allocates a
    temporary each time; the gradient clip scales every gradient in place (src is dst). Same products.
    """
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _patch_multi_tensor_scale() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl.__name__ == "local_multi_tensor_scale":  # apex absent
            module.multi_tensor_scale_impl = _foreach_scale


def _define_te_general_gemm() -> None:
    """megatron-core 0.16.1's MoE router reads `moe_utils.te_general_gemm`, a name the module defines only
    when Transformer Engine imports (a NameError in every MoE forward otherwise); without it, None selects
    the router's torch matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> None:
    """Adapt megatron-core to this CPU-only process (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CPU compatibility layer is for processes without a visible GPU; "
                           "set CUDA_VISIBLE_DEVICES='' to train on CPU on a GPU machine")
    cpu_torch = _CpuTorch()
    for module in _megatron_modules():
        if getattr(module, "torch", None) is torch:
            module.torch = cpu_torch
    _install_cpu_rng_tracker()
    _patch_tensor_type()
    _patch_tensor_cuda()
    _patch_multi_tensor_scale()
    _define_te_general_gemm()
    _APPLIED = True
