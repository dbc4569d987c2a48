"""The benchmark suite in one run: every benchmark of benchmarks/, one after the other.

    hybridflow bench all [--quick] [--only NAME,NAME] [--json DIR]

Each benchmark runs as its own process (`benchmarks/bench_NAME.py` with the
arguments in `SUITE`, the small ones under `--quick`) and prints its own
table of ratios, measured side by side inside it; this script adds, per
benchmark, the wall time and the peak resident memory of its process tree
(sampled every 0.1 s with psutil: children such as torchrun ranks or Ray
workers count), and a summary. `--json DIR` writes `DIR/all.json` (the
summary) and passes `--json DIR/NAME.json` to each benchmark that writes
its figures; those carry the peak memory each benchmark measures inside,
side by side with its baseline (README.md). One failing benchmark does not stop the others; the exit status
says whether all passed.

Left out: `bench csrc`, which compares the C++ build of this tree with that of
another revision (`hybridflow bench csrc --baseline REV`), and the TRL side of
`bench trl`, which needs a Python with TRL installed (`--trl-python`); its
hybridflow side runs here.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ (hybridflow bench runs this by path)
from figures import write_json  # noqa: E402

# name -> (arguments of the full run, of the --quick run, whether it takes --json).
SUITE: dict[str, tuple[list[str], list[str], bool]] = {
    "kernels": ([], ["--quick"], True),
    "layers": ([], ["--quick"], True),
    "rollout": ([], ["--quick"], True),
    "controller": ([], ["--quick"], True),
    "reshard": ([], ["--quick"], False),
    "data_plane": ([], ["--steps", "1"], False),
    "update_memory": ([], ["--layers", "1", "--batch", "4", "--micro", "4", "--prompt", "32", "--response", "32",
                           "--vocab", "8192", "--hidden", "256"], True),
    "fsdp": ([], ["--quick"], True),
    "long_context": ([], ["--seq", "1024", "--cps", "1,2", "--layers", "1"], True),
    "e2e": ([], ["--steps", "2", "--warmup", "1"], True),
    "calibrate": ([], ["--rounds", "1"], True),
    "trl": ([], ["--steps", "2", "--warmup", "1"], True),
    "async": ([], ["--steps", "1", "--warmup", "1", "--prompts", "8", "--val", "20"], True),
    "dapo": ([], ["--prompts", "256", "--every", "128", "--val", "20"], True),
    "moe": ([], ["--tokens", "256", "--steps", "1", "--decode-tokens", "8"], True),
    "scoring": ([], ["--quick"], True),
    "lora": ([], ["--model", "hybridflow/assets/demo_model", "--ranks", "8", "--steps", "1", "--rows", "2", "--seq",
                  "32", "--no-tp"], True),
}
LEFT_OUT = {"csrc": "compares two builds: hybridflow bench csrc --baseline REV", "all": "this script"}


def run_one(name: str, argv: list[str]) -> dict:
    """Run bench_NAME.py with `argv`, streaming its output; its wall time, peak RSS (MiB) and exit code."""
    import psutil

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    start, peak = time.perf_counter(), 0
    proc = subprocess.Popen([sys.executable, str(HERE / f"bench_{name}.py"), *argv], env=env)
    watch = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [watch, *watch.children(recursive=True)]
            peak = max(peak, sum(_rss(p) for p in tree))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.1)
    return {"seconds": time.perf_counter() - start, "peak_mib": peak / 2**20, "exit": proc.returncode}


def _rss(process) -> int:
    import psutil

    try:
        return process.memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark at a small size")
    parser.add_argument("--only", help=f"comma-separated names, of {sorted(SUITE)}")
    parser.add_argument("--json", type=Path, metavar="DIR", help="write all.json and each benchmark's figures here")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] if args.only else list(SUITE)
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        reasons = {n: LEFT_OUT[n] for n in unknown if n in LEFT_OUT}
        parser.error(f"not in the suite: {unknown} {reasons or ''}; it has {sorted(SUITE)}")
    if args.json:
        args.json.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        full, quick, writes_json = SUITE[name]
        bench_argv = list(quick if args.quick else full)
        if args.json and writes_json:
            bench_argv += ["--json", str(args.json / f"{name}.json")]
        print(f"\n=== bench {name} {' '.join(bench_argv)}", flush=True)
        results[name] = {"argv": bench_argv, **run_one(name, bench_argv)}
    print("\n" + summary(results), flush=True)
    if args.json:
        write_json(args.json / "all.json", {"quick": args.quick, "results": results})
    return 0 if all(r["exit"] == 0 for r in results.values()) else 1


def summary(results: dict) -> str:
    lines = [f"{'benchmark':16s} {'seconds':>8s} {'peak MiB':>9s}  status"]
    for name, r in results.items():
        status = "ok" if r["exit"] == 0 else f"FAILED (exit {r['exit']})"
        lines.append(f"{name:16s} {r['seconds']:8.1f} {r['peak_mib']:9.0f}  {status}")
    lines.append(f"{'all':16s} {sum(r['seconds'] for r in results.values()):8.1f} "
                 f"{max((r['peak_mib'] for r in results.values()), default=0):9.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
