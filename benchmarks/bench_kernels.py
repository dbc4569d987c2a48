"""Kernel benchmark: each kernel against its eager reference, side by side in one run.

    python benchmarks/bench_kernels.py [--quick] [--json PATH]

Prints time (median of repeats), the speed-up reference / kernel, and the
extra peak memory of each with the ratio kernel / reference: for log-prob
and the fused output layer, bytes allocated during the call from
torch.profiler's allocation events (process RSS is too coarse at these
sizes); for GAE, whose reference is a Python loop of thousands of small ops
that the profiler would slow by orders of magnitude, the rise of the
process's peak resident memory during the call (`figures.py`; marked
`rss`). `--json PATH` writes every row.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybridflow.kernels.masked import masked_whiten
from hybridflow.kernels import (
    fused_linear_logprob_entropy, fused_linear_reference, gae, gae_reference, logprob_entropy,
    logprob_entropy_reference)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import mib, peak_extra_mib, ratio, write_json  # noqa: E402


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (and JIT build of the extension)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_extra_bytes(fn) -> int:
    """Peak of live bytes allocated during `fn`, from the profiler's allocation events."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    # Self memory only: an op's total also counts what the ops it calls
    # allocate, which would count one allocation twice.
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _row(name, ref_fn, fast_fn, repeats, memory="allocated") -> dict:
    """Time both, then their extra peak memory: allocated bytes (profiler) or the resident high-water mark."""
    t_ref, t_fast = _time(ref_fn, repeats), _time(fast_fn, repeats)
    if memory == "rss":
        m_ref, m_fast = peak_extra_mib(ref_fn)[1], peak_extra_mib(fast_fn)[1]
    else:
        m_ref, m_fast = _peak_extra_bytes(ref_fn) / 2**20, _peak_extra_bytes(fast_fn) / 2**20
    print(f"{name:44s} {t_ref * 1e3:10.2f} {t_fast * 1e3:10.2f} {t_ref / t_fast:7.1f}x {mib(m_ref)} {mib(m_fast)} "
          f"{ratio(m_fast, m_ref)} {memory}", flush=True)
    return {"kernel": name, "ref_ms": t_ref * 1e3, "ours_ms": t_fast * 1e3, "speedup": t_ref / t_fast,
            "ref_peak_mib": m_ref, "ours_peak_mib": m_fast, "memory": memory}


def gae_inputs(t: int, device: str = "cpu", rows: int = 64):
    """Rewards, values [rows, t] ~ N(0, 1) and a mask with about 10% of steps masked."""
    g = torch.Generator(device=device).manual_seed(0)
    r, v = torch.randn(rows, t, generator=g, device=device), torch.randn(rows, t, generator=g, device=device)
    return r, v, (torch.rand(rows, t, generator=g, device=device) > 0.1).float()


def bench_gae(sizes, repeats) -> list[dict]:
    rows = []
    for t in sizes:
        r, v, m = gae_inputs(t)
        rows.append(_row(f"gae B=64 T={t} (loop ref vs cpu)", lambda: gae_reference(r, v, m, 0.99, 0.95),
                         lambda: gae(r, v, m, 0.99, 0.95, backend="cpu"), repeats, memory="rss"))
        # What PPO runs (verl's compute_gae_advantage_return: the loop, then masked_whiten): the
        # reference that way, against the scan with the whitening fused in, and the scan followed by
        # masked_whiten (the path before the fusion).
        whitened_ref = lambda: masked_whiten(gae_reference(r, v, m, 0.99, 0.95)[0], m)  # noqa: E731
        rows.append(_row(f"gae+whiten B=64 T={t} (loop+whiten vs fused)", whitened_ref,
                         lambda: gae(r, v, m, 0.99, 0.95, backend="cpu", whiten=True), repeats, memory="rss"))
        rows.append(_row(f"gae+whiten B=64 T={t} (cpu+whiten vs fused)",
                         lambda: masked_whiten(gae(r, v, m, 0.99, 0.95, backend="cpu")[0], m),
                         lambda: gae(r, v, m, 0.99, 0.95, backend="cpu", whiten=True), repeats, memory="rss"))
    return rows


def logprob_step(fn, logits, labels, backward: bool):
    """One call as a closure: forward, or forward + backward of sum(logp) + sum(entropy)."""
    def go():
        lp, ent = fn(logits, labels)
        if backward:
            (lp.sum() + ent.sum()).backward()
            logits.grad = None
    return go


def _logprob_case(n, v, backward):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=g).requires_grad_(backward)
    labels = torch.randint(0, v, (n,), generator=g)
    return lambda fn: logprob_step(fn, logits, labels, backward)


def bench_logprob(shapes, repeats) -> list[dict]:
    rows = []
    for n, v in shapes:
        for backward in (False, True):
            run = _logprob_case(n, v, backward)
            rows.append(_row(f"logprob+entropy {n}x{v} {'fwd+bwd' if backward else 'fwd'}",
                             run(logprob_entropy_reference), run(lambda x, y: logprob_entropy(x, y, backend="cpu")),
                             repeats))
    return rows


def bench_logprob_in_place(shapes, hidden: int = 896) -> list[dict]:
    """Forward + backward of the C++ kernel with the backward out of place and in place, peak RSS.

    - slice: log-probs of the response columns of a model output [2, n/2 + 1, V] (the actor today).
      The kernel copies the strided slice either way; in place, the gradient overwrites that copy.
    - output layer: logits = h @ W^T for the n response positions only, then the kernel, with
      `inplace_backward` off and on (the caller keeps nothing of the logits).
    """
    print(f"\n{'C++ log-prob backward, peak RSS':52s} {'out-of-place MiB':>17s} {'in-place MiB':>13s} "
          f"{'logits MiB':>11s}")
    rows = []
    for n, v in shapes:
        g = torch.Generator().manual_seed(0)
        out = torch.randn(2, n // 2 + 1, v, generator=g).requires_grad_(True)
        labels = torch.randint(0, v, (2, n // 2), generator=g)

        def sliced(slice_fn):
            def go():
                lp, ent = logprob_entropy(slice_fn(out), labels, backend="cpu")
                (lp.sum() + ent.sum()).backward()
                out.grad = None
            return go
        before = peak_extra_mib(sliced(lambda t: t[:, :-1].contiguous()))[1]  # the caller's copy: kept
        after = peak_extra_mib(sliced(lambda t: t[:, :-1]))[1]
        rows.append(_in_place_row(f"slice of a model output, {n}x{v}", before, after, n * v * 4 / 2**20))
        del out
        h = torch.randn(n, hidden, generator=g).requires_grad_(True)
        w = (torch.randn(v, hidden, generator=g) * 0.02).requires_grad_(True)

        def head(inplace):
            def go():
                lp, ent = logprob_entropy(h @ w.T, labels.reshape(-1), backend="cpu", inplace_backward=inplace)
                (lp.sum() + ent.sum()).backward()
                h.grad = w.grad = None
            return go
        head(False)()  # first touch of w.grad's pages etc.
        before, after = peak_extra_mib(head(False))[1], peak_extra_mib(head(True))[1]
        rows.append(_in_place_row(f"output layer on {n} positions, h={hidden} -> {v}", before, after,
                                  n * v * 4 / 2**20))
    return rows


def _in_place_row(name: str, out_of_place, in_place, logits_mib: float) -> dict:
    print(f"{name:52s} {mib(out_of_place, 17)} {mib(in_place, 13)} {logits_mib:11.0f}", flush=True)
    return {"case": name, "out_of_place_peak_mib": out_of_place, "in_place_peak_mib": in_place,
            "logits_mib": logits_mib}


def bench_fused(n, hiddens, vocab, repeats) -> list[dict]:
    rows = []
    for h in hiddens:
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(n, h, generator=g).requires_grad_(True)
        weight = (torch.randn(vocab, h, generator=g) * 0.02).requires_grad_(True)
        labels = torch.randint(0, vocab, (n,), generator=g)

        def run(fn):
            def go():
                lp, ent = fn(hidden, weight, labels)
                (lp.sum() + ent.sum()).backward()
                hidden.grad = weight.grad = None
            return go
        rows.append(_row(f"fused linear {n}x{h}->{vocab} fwd+bwd", run(fused_linear_reference),
                         run(fused_linear_logprob_entropy), repeats))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument("--only", default="gae,logprob,fused", help="comma-separated subset")
    parser.add_argument("--hidden", default="896,3584", help="hidden sizes for the fused linear case")
    parser.add_argument("--json", help="also write every row's figures here")
    args = parser.parse_args()
    only = {"gae", "logprob", "fused"} if args.quick else set(args.only.split(","))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'kernel':44s} {'ref ms':>10s} {'ours ms':>10s} {'speedup':>8s} "
          f"{'ref MiB':>9s} {'ours MiB':>9s} {'mem':>6s} memory")
    rows, in_place = [], []
    if "gae" in only:
        rows += bench_gae([128] if args.quick else [512, 2048, 8192], 2 if args.quick else 3)
    if "logprob" in only:
        shapes = [(256, 4096)] if args.quick else [(4096, 32000), (4096, 151936)]
        rows += bench_logprob(shapes, 2 if args.quick else 3)
        in_place = bench_logprob_in_place(shapes)
    if "fused" in only:
        rows += (bench_fused(256, [64], 4096, 2) if args.quick
                 else bench_fused(4096, [int(h) for h in args.hidden.split(",")], 151936, 1))
    if args.json:
        write_json(args.json, {"quick": args.quick, "kernels": rows, "logprob_backward_peak_rss": in_place})


if __name__ == "__main__":
    main()
