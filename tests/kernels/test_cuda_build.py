"""The CUDA kernels build, and their per-thread code equals the reference, on a machine without a GPU.

- `csrc/cuda/logprob_entropy.cu` and `csrc/cuda/gae.cu` (torch-free) compile
  with nvcc for sm_90, with the defines torch's JIT build adds, warnings as errors;
- `csrc/cuda/binding.cpp` compiles against torch's headers (syntax only);
- `tests/kernels/cuda_host_harness.cu` runs the kernels' per-thread code on
  the CPU (one emulated block per row) and matches `logprob_entropy_reference`
  and `chunk_grad`; `tests/kernels/cuda_gae_harness.cu` runs the GAE
  kernel's 32 lanes and its warp scan (in the shuffles' order) against
  `gae_reference`. Shuffles, shared memory and launches need a GPU:
  tests/kernels/test_logprob_cuda.py;
- without a CUDA device, `auto` on a CUDA tensor falls back to `chunked` and
  says why, and asking for `cuda` by name raises.

Without nvcc the compile checks skip, unless HYBRIDFLOW_REQUIRE_NVCC=1 (set by `make test` where it
finds nvcc), which turns the skip into a failure.
"""
import logging
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from hybridflow.kernels.backend import BackendUnavailable, warn_once, resolve
from hybridflow.kernels.logprob import chunk_grad, logprob_entropy_reference
from tests.kernels.test_logprob import CASES, _inputs

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "csrc" / "cuda" / "logprob_entropy.cu"
GAE_KERNEL = ROOT / "csrc" / "cuda" / "gae.cu"
GAE_HARNESS = Path(__file__).with_name("cuda_gae_harness.cu")
BINDING = ROOT / "csrc" / "cuda" / "binding.cpp"
HARNESS = Path(__file__).with_name("cuda_host_harness.cu")
NVCC_FALLBACKS = ["/usr/local/cuda/bin/nvcc"]  # where nvcc lives when it is not on PATH
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # hybridflow_cuda::Dtype


def _nvcc() -> str:
    """nvcc's path; a skip where it is missing, a failure where HYBRIDFLOW_REQUIRE_NVCC=1 says it must exist
    (`make test` sets that when it finds nvcc, so the compile checks cannot quietly stop running)."""
    found = shutil.which("nvcc") or next((p for p in NVCC_FALLBACKS if Path(p).is_file()), None)
    if found is None:
        why = "nvcc not found on PATH or in /usr/local/cuda/bin: cannot compile-check the CUDA sources"
        if os.environ.get("HYBRIDFLOW_REQUIRE_NVCC") == "1":
            pytest.fail(f"{why} (HYBRIDFLOW_REQUIRE_NVCC=1)", pytrace=False)
        pytest.skip(why)
    return found


@pytest.mark.parametrize("required, outcome", [("1", pytest.fail.Exception), ("0", pytest.skip.Exception)])
def test_missing_nvcc_fails_where_required_and_skips_elsewhere(monkeypatch, tmp_path, required, outcome):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvcc on PATH
    monkeypatch.setattr(f"{__name__}.NVCC_FALLBACKS", [str(tmp_path / "nvcc")])
    monkeypatch.setenv("HYBRIDFLOW_REQUIRE_NVCC", required)
    with pytest.raises(outcome, match="nvcc not found"):
        _nvcc()


def _nvcc_flags(std: str) -> list[str]:
    """The flags torch's JIT build passes nvcc, for sm_90 (H100/H200)."""
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    return ["-arch=sm_90", f"-std={std}", "-O3", *cpp_extension.COMMON_NVCC_FLAGS, *includes]


def _run(cmd: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.parametrize("source", [KERNELS, GAE_KERNEL], ids=lambda p: p.name)
@pytest.mark.parametrize("std", ["c++17", "c++20"])  # c++20: what torch.utils.cpp_extension.load passes
def test_kernels_compile_for_sm90(tmp_path, std, source):
    _run([_nvcc(), "-c", *_nvcc_flags(std), "--Werror", "all-warnings", str(source), "-o", str(tmp_path / "k.o")])
    assert (tmp_path / "k.o").stat().st_size > 0


def test_kernels_use_16_byte_loads_and_stores(tmp_path):
    _run([_nvcc(), "-ptx", *_nvcc_flags("c++17"), str(KERNELS), "-o", str(tmp_path / "k.ptx")])
    ptx = (tmp_path / "k.ptx").read_text()
    assert "ld.global.nc.v4" in ptx and "st.global.v4" in ptx and "ex2.approx" in ptx


def test_binding_compiles_against_torch_headers():
    cxx = shutil.which("c++") or pytest.skip("no C++ compiler")
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    _run([cxx, "-fsyntax-only", "-std=c++20", "-Wall", "-Werror", "-DTORCH_EXTENSION_NAME=hybridflow_cuda_check",
          *includes, str(BINDING)])


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("cuda_harness") / "harness"
    _run([_nvcc(), *_nvcc_flags("c++17"), str(HARNESS), "-o", str(exe)])
    return exe


def _harness_run(exe, logits, labels, g_logp, g_ent, threads=0, in_offset=0, out_offset=0):
    n, v = logits.shape
    head = torch.tensor([DTYPE_CODES[logits.dtype], n, v, threads, in_offset, out_offset], dtype=torch.int64)
    parts = [head, logits, labels.long(), g_logp.float(), g_ent.float()]
    raw = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in parts)
    out = subprocess.run([str(exe)], input=raw, capture_output=True, check=True, timeout=60).stdout
    buf = torch.frombuffer(bytearray(out), dtype=torch.uint8)
    stats = buf[: 12 * n].view(torch.float32).view(3, n)
    return stats[0], stats[1], stats[2], buf[12 * n:].view(logits.dtype).view(n, v)


def _expected(logits, labels, g_logp, g_ent):
    """Reference logp, entropy, lse and logits gradient; an invalid label gets NaN and no label gradient."""
    valid = (labels >= 0) & (labels < logits.shape[1])
    safe = torch.where(valid, labels, 0)
    logp, ent = logprob_entropy_reference(logits, safe)
    lse = torch.logsumexp(logits.float(), -1)
    grad = chunk_grad(logits, safe, lse, ent, g_logp, g_ent, label_grad=torch.where(valid, g_logp, 0.0))
    return torch.where(valid, logp, float("nan")), ent, lse, grad


def _compare(out, expect, rtol, atol):
    for name, a, b in zip(("logp", "entropy", "lse", "grad"), out, expect):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _grads(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("threads", [0, 32])  # 0: as launched; 32: several packs per thread
@pytest.mark.parametrize("n, v, scale", CASES)
def test_harness_matches_reference_float32(harness, n, v, scale, threads):
    logits, labels = _inputs(n, v, scale)
    g_logp, g_ent = _grads(n)
    out = _harness_run(harness, logits, labels, g_logp, g_ent, threads)
    _compare(out, _expected(logits, labels, g_logp, g_ent), rtol=1e-4, atol=1e-4 * max(1.0, scale / 10))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_offset, out_offset", [(0, 0), (3, 3), (1, 0)])  # aligned, scalar head, mixed
def test_harness_matches_reference_half_precision(harness, dtype, in_offset, out_offset):
    logits, labels = _inputs(48, 2051, 4.0, dtype=dtype)
    g_logp, g_ent = _grads(48)
    out = _harness_run(harness, logits, labels, g_logp, g_ent, 64, in_offset, out_offset)
    assert out[3].dtype == dtype
    _compare(out, _expected(logits, labels, g_logp, g_ent), rtol=2e-2, atol=2e-2)


def test_harness_masked_logits_and_invalid_labels(harness):
    """-inf logits contribute nothing (the reference would give NaN); labels outside [0, V) give NaN logp."""
    logits, labels = _inputs(6, 1000, 3.0)
    logits[:, 500:700] = float("-inf")
    labels[:] = torch.tensor([-100, 1000, 5, 999, 0, 499])  # none in the masked columns
    g_logp, g_ent = _grads(6)
    out = _harness_run(harness, logits, labels, g_logp, g_ent, 512)
    finite = logits.clamp(min=-1e4)  # exp underflows to exactly 0: the same distribution, no NaN
    _compare(out, _expected(finite, labels, g_logp, g_ent), rtol=1e-4, atol=1e-4)
    assert out[0][:2].isnan().all() and out[0][2:].isfinite().all() and out[1].isfinite().all()
    assert (out[3][:, 500:700] == 0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where no CUDA device exists")
def test_without_cuda_auto_falls_back_to_chunked_and_cuda_by_name_raises(caplog):
    warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hybridflow.kernels"):
        assert resolve("auto", torch.device("cuda"), ("cpu", "cuda", "chunked")) == "chunked"
    assert "CUDA kernels unavailable" in caplog.text and "no CUDA device" in caplog.text
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        resolve("cuda", torch.device("cuda"), ("cpu", "cuda", "chunked"))


@pytest.fixture(scope="module")
def gae_harness(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("cuda_gae_harness") / "harness"
    _run([_nvcc(), *_nvcc_flags("c++17"), str(GAE_HARNESS), "-o", str(exe)])
    return exe


@pytest.mark.parametrize("rows, steps", [(6, 9), (5, 1), (3, 31), (4, 32), (3, 33), (2, 1000), (64, 2048)])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_harness_matches_reference(gae_harness, rows, steps, gamma, lam):
    """Fewer steps than lanes (idle lanes), chunk edges, long rows; padding, holes, empty and length-1 rows."""
    from hybridflow.kernels.gae import gae_reference
    from tests.kernels.test_gae import _inputs as gae_inputs

    r, v, m = gae_inputs(rows, steps, seed=steps)
    head = torch.tensor([rows, steps], dtype=torch.int64).view(torch.uint8)
    coef = torch.tensor([gamma, lam], dtype=torch.float32).view(torch.uint8)
    raw = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in (head, coef, r, v, m))
    out = subprocess.run([str(gae_harness)], input=raw, capture_output=True, check=True, timeout=60).stdout
    adv, ret = torch.frombuffer(bytearray(out), dtype=torch.float32).view(2, rows, steps)
    want_adv, want_ret = gae_reference(r.double(), v.double(), m, gamma, lam)
    # float32 sums of up to `steps` terms, associated differently from the sequential scan
    tol = 1e-5 * max(1.0, (steps if gamma * lam == 1.0 else 1 / (1 - gamma * lam + 1e-9)) ** 0.5)
    torch.testing.assert_close(adv, want_adv.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(ret, want_ret.float(), rtol=tol, atol=tol)
