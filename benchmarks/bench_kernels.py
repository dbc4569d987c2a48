"""Kernel benchmark: each kernel against its eager reference, side by side in one run.

    python benchmarks/bench_kernels.py [--quick]

Prints time (median of repeats), the speed-up reference / kernel, and the
extra peak memory of each (bytes allocated during the call, from
torch.profiler's allocation events, since process RSS is too coarse) with
the ratio kernel / reference.
"""
from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybridflow.kernels.masked import masked_whiten
from hybridflow.kernels import (
    fused_linear_logprob_entropy, fused_linear_reference, gae, gae_reference, logprob_entropy,
    logprob_entropy_reference)


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


def _row(name, ref_fn, fast_fn, repeats, memory=True):
    t_ref, t_fast = _time(ref_fn, repeats), _time(fast_fn, repeats)
    m_ref = _peak_extra_bytes(ref_fn) if memory else 0
    m_fast = _peak_extra_bytes(fast_fn) if memory else 0
    mem = f"{m_ref / 2**20:9.1f} {m_fast / 2**20:9.1f} {m_fast / max(m_ref, 1):6.3f}" if memory else " " * 33
    print(f"{name:44s} {t_ref * 1e3:10.2f} {t_fast * 1e3:10.2f} {t_ref / t_fast:7.1f}x {mem}", flush=True)


def gae_inputs(t: int, device: str = "cpu", rows: int = 64):
    """Rewards, values [rows, t] ~ N(0, 1) and a mask with about 10% of steps masked."""
    g = torch.Generator(device=device).manual_seed(0)
    r, v = torch.randn(rows, t, generator=g, device=device), torch.randn(rows, t, generator=g, device=device)
    return r, v, (torch.rand(rows, t, generator=g, device=device) > 0.1).float()


def bench_gae(sizes, repeats):
    for t in sizes:
        r, v, m = gae_inputs(t)
        _row(f"gae B=64 T={t} (loop ref vs cpu)", lambda: gae_reference(r, v, m, 0.99, 0.95),
             lambda: gae(r, v, m, 0.99, 0.95, backend="cpu"), repeats, memory=False)
        # What PPO runs (verl's compute_gae_advantage_return: the loop, then masked_whiten): the
        # reference that way, against the scan with the whitening fused in, and the scan followed by
        # masked_whiten (the path before the fusion).
        whitened_ref = lambda: masked_whiten(gae_reference(r, v, m, 0.99, 0.95)[0], m)  # noqa: E731
        _row(f"gae+whiten B=64 T={t} (loop+whiten vs fused)", whitened_ref,
             lambda: gae(r, v, m, 0.99, 0.95, backend="cpu", whiten=True), repeats, memory=False)
        _row(f"gae+whiten B=64 T={t} (cpu+whiten vs fused)",
             lambda: masked_whiten(gae(r, v, m, 0.99, 0.95, backend="cpu")[0], m),
             lambda: gae(r, v, m, 0.99, 0.95, backend="cpu", whiten=True), repeats, memory=False)


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


def bench_logprob(shapes, repeats):
    for n, v in shapes:
        for backward in (False, True):
            run = _logprob_case(n, v, backward)
            _row(f"logprob+entropy {n}x{v} {'fwd+bwd' if backward else 'fwd'}",
                 run(logprob_entropy_reference), run(lambda x, y: logprob_entropy(x, y, backend="cpu")),
                 repeats)


def _peak_rss_extra_mib(fn) -> float:
    """Peak resident memory during `fn()` beyond what was resident before it (Linux: VmHWM after
    resetting it through /proc/self/clear_refs). Counts every allocation, the extensions' too,
    which the profiler's per-op events do not."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS:")
    fn()
    return (status("VmHWM:") - base) / 2**20


def bench_logprob_in_place(shapes, hidden: int = 896):
    """Forward + backward of the C++ kernel with the backward out of place and in place, peak RSS.

    - slice: log-probs of the response columns of a model output [2, n/2 + 1, V] (the actor today).
      The kernel copies the strided slice either way; in place, the gradient overwrites that copy.
    - output layer: logits = h @ W^T for the n response positions only, then the kernel, with
      `inplace_backward` off and on (the caller keeps nothing of the logits).
    """
    print(f"\n{'C++ log-prob backward, peak RSS':52s} {'out-of-place MiB':>17s} {'in-place MiB':>13s} "
          f"{'logits MiB':>11s}")
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
        before = _peak_rss_extra_mib(sliced(lambda t: t[:, :-1].contiguous()))  # the caller's copy: kept
        after = _peak_rss_extra_mib(sliced(lambda t: t[:, :-1]))
        print(f"{f'slice of a model output, {n}x{v}':52s} {before:17.0f} {after:13.0f} {n * v * 4 / 2**20:11.0f}")
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
        before, after = _peak_rss_extra_mib(head(False)), _peak_rss_extra_mib(head(True))
        print(f"{f'output layer on {n} positions, h={hidden} -> {v}':52s} {before:17.0f} {after:13.0f} "
              f"{n * v * 4 / 2**20:11.0f}", flush=True)


def bench_fused(n, hiddens, vocab, repeats):
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
        _row(f"fused linear {n}x{h}->{vocab} fwd+bwd", run(fused_linear_reference),
             run(fused_linear_logprob_entropy), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument("--only", default="gae,logprob,fused", help="comma-separated subset")
    parser.add_argument("--hidden", default="896,3584", help="hidden sizes for the fused linear case")
    args = parser.parse_args()
    only = set(args.only.split(","))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'kernel':44s} {'ref ms':>10s} {'ours ms':>10s} {'speedup':>8s} "
          f"{'ref MiB':>9s} {'ours MiB':>9s} {'mem':>6s}")
    if args.quick:
        bench_gae([128], 2)
        bench_logprob([(256, 4096)], 2)
        bench_logprob_in_place([(256, 4096)])
        bench_fused(256, [64], 4096, 2)
        return
    if "gae" in only:
        bench_gae([512, 2048, 8192], 3)
    if "logprob" in only:
        bench_logprob([(4096, 32000), (4096, 151936)], 3)
        bench_logprob_in_place([(4096, 32000), (4096, 151936)])
    if "fused" in only:
        bench_fused(4096, [int(h) for h in args.hidden.split(",")], 151936, 1)


if __name__ == "__main__":
    main()
