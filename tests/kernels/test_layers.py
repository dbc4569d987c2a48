"""The C++ RMSNorm, SwiGLU and rotary kernels equal their references, values and gradients; where they do
not apply (another dtype), the reference runs; asked for by name, they refuse."""
import pytest
import torch

from hybridflow.kernels import BackendUnavailable
from hybridflow.kernels.layers import (
    rms_norm, rms_norm_reference, rotary, rotary_reference, swiglu, swiglu_reference)


def _randn(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _value_and_grads(fn, inputs, *args):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves, *args)
    # The incoming gradient in reversed memory order: the kernels must not assume a contiguous one.
    grad = _randn(*reversed(out.shape), seed=99).permute(*reversed(range(out.dim())))
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def _assert_same(kernel, reference, inputs, *args, rtol=1e-5, atol=1e-5):
    got = _value_and_grads(kernel, inputs, *args)
    want = _value_and_grads(reference, inputs, *args)
    for name, a, b in zip(["output", *(f"grad {i}" for i in range(len(inputs)))], got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("shape, scale", [((51, 24, 128), 1.0), ((1, 1, 7), 3.0), ((300, 96), 1e-3),
                                          ((8, 4, 64), 1e3)])
def test_rms_norm_matches_reference(shape, scale):
    x, weight = _randn(*shape, scale=scale), _randn(shape[-1], seed=1) + 1.0
    # The weight's gradient sums over all rows: its tolerance grows with their number.
    _assert_same(lambda a, w: rms_norm(a, w, 1e-6, backend="cpu"), lambda a, w: rms_norm_reference(a, w, 1e-6),
                 [x, weight], atol=1e-5 * max(1, x.numel() // shape[-1]) ** 0.5)


@pytest.mark.parametrize("shape, scale", [((51, 24, 768), 3.0), ((1, 2), 1.0), ((5, 3, 130), 40.0)])
def test_swiglu_matches_reference(shape, scale):
    x = _randn(*shape, scale=scale)
    gates = min(4, shape[-1] // 2)  # saturated and zero gates in the first row
    x.view(-1, shape[-1])[0, :gates] = torch.tensor([0.0, -100.0, 100.0, -1e-7])[:gates]
    _assert_same(lambda a: swiglu(a, backend="cpu"), swiglu_reference, [x], rtol=2e-5, atol=1e-5 * scale)


def _angles(s, b, d, seed=2):
    half = _randn(s, b, d // 2, scale=5.0, seed=seed)
    angles = torch.cat((half, half), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("angle_rows", [1, 6])
def test_rotary_matches_reference_on_a_strided_view(angle_rows):
    """q is a strided view of the fused qkv projection, as in megatron-core's attention; cos and sin are
    shared by the rows ([s, 1, d]) or one per row ([s, b, d], shared-prompt positions)."""
    s, b, d = 9, 6, 32
    qkv = _randn(s, b, 2, 3 * d)
    cos, sin = _angles(s, angle_rows, d)

    def split_q(fn):
        return lambda x, c, n: fn(x.view(s, b, 2, 3, d)[:, :, :, 0], c, n)
    # The gradients of cos and sin are left out: the kernel takes constant angles.
    _assert_same(lambda x: split_q(lambda q, c, n: rotary(q, c, n, backend="cpu"))(x, cos, sin),
                 lambda x: split_q(rotary_reference)(x, cos, sin), [qkv])


def test_rotary_backward_is_the_transpose_for_unequal_halves():
    """The two halves of cos and sin need not match (the kernel does not assume it)."""
    s, b, h, d = 4, 3, 2, 8
    cos, sin = _randn(s, 1, d, seed=3), _randn(s, 1, d, seed=4)
    _assert_same(lambda t: rotary(t, cos, sin, backend="cpu"), lambda t: rotary_reference(t, cos, sin),
                 [_randn(s, b, h, d)])


def test_other_dtypes_run_the_reference_and_cpu_by_name_refuses_them():
    x = _randn(4, 16).bfloat16()
    weight = torch.ones(16, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    assert torch.equal(swiglu(x), swiglu_reference(x))
    with pytest.raises(BackendUnavailable, match="float32 CPU tensors"):
        swiglu(x, backend="cpu")


def test_a_cached_build_is_keyed_by_sources_headers_and_flags(tmp_path):
    """A changed header or compiler flag must build anew, not load the old build from the cache."""
    from hybridflow.kernels.backend import build_digest
    src, header = tmp_path / "k.cpp", tmp_path / "k.h"
    src.write_text("int f();")
    header.write_text("// v1")
    flags = {"extra_cflags": ["-O3"]}
    first = build_digest([src], (header,), flags)
    assert build_digest([src], (header,), {"extra_cflags": ["-O3"]}) == first
    assert build_digest([src], (header,), {"extra_cflags": ["-O3", "-fno-trapping-math"]}) != first
    header.write_text("// v2")
    assert build_digest([src], (header,), flags) != first


def test_using_cpu_build_swaps_the_extension_inside_the_block_only():
    """`bench csrc` alternates two builds through it: every kernel must see the swapped one, then the old."""
    import types

    from hybridflow.kernels import backend
    own = backend.cpu_extension()
    other = types.SimpleNamespace(swiglu_forward=lambda x: torch.zeros(x.shape[:-1] + (x.shape[-1] // 2,)))
    x = _randn(3, 8)
    with backend.using_cpu_build(other):
        assert backend.cpu_extension() is other
        assert torch.equal(swiglu(x), torch.zeros(3, 4))  # the layer kernels call the swapped build
    assert backend.cpu_extension() is own
    torch.testing.assert_close(swiglu(x), swiglu_reference(x))


def test_sources_are_compiled_from_copies_under_the_digest_so_any_checkout_loads_one_build(tmp_path):
    """torch's build files name the sources' paths: two checkouts of the same bytes stage to the same
    copies (so the second loads the first's build), a changed byte is copied anew, and no partial copy
    is left behind."""
    from hybridflow.kernels.backend import _stage_sources
    into = tmp_path / "build" / "src"
    (tmp_path / "build").mkdir()
    staged = {}
    for checkout in ("a", "b"):
        d = tmp_path / checkout
        d.mkdir()
        (d / "k.cpp").write_text('#include "k.h"\nint f() { return K; }\n')
        (d / "k.h").write_text("#define K 1\n")
        staged[checkout] = _stage_sources(into, [d / "k.cpp", d / "k.h"])
    assert staged["a"] == staged["b"] == [into / "k.cpp", into / "k.h"]
    assert (into / "k.h").read_text() == "#define K 1\n"
    (tmp_path / "b" / "k.h").write_text("#define K 2\n")
    _stage_sources(into, [tmp_path / "b" / "k.cpp", tmp_path / "b" / "k.h"])
    assert (into / "k.h").read_text() == "#define K 2\n"
    assert sorted(p.name for p in into.iterdir()) == ["k.cpp", "k.h"]
