"""End-to-end RL iteration benchmark: where a PPO and a GRPO step on the demo task spend their time.

    hybridflow bench e2e [--steps N] [--warmup W] [--algo grpo,ppo] [--json PATH]
                         [--baseline REV] [-o KEY=VALUE ...]

Each algorithm runs `configs/demo.yaml` in-process (the local launcher, one
CPU process) for W warm-up steps and N timed ones, and reports per stage the
median seconds, its share of the step and the step's tokens/s:

    rollout, reward, log_probs, values   the DataFlow nodes (log_probs: reference and old, one call)
    advantages (with the KL in the reward and the uniform-group filter)
    update                                              critic and actor updates
    transition                                          weights -> generation
    other                                               the step minus the above

and the megabytes of tensors the controller's calls delivered to the ranks
in a step (what Ray would move; counted at the dispatch, so a baseline tree
is counted the same way), and the peak resident memory of the process over
the timed steps (`peak_mib`: its high-water mark, reset after the warm-up
steps, `figures.py`; models, optimizer states and the step's activations,
all in this one process).

GRPO is the demo as configured; PPO is the same task with GAE, a critic and a
reference model (KL loss), and no uniform-group filter.

`--baseline REV` runs this same script on a git worktree of REV (a commit or
branch of this repository), in a subprocess whose `hybridflow` is that
tree's, and here, and prints the two side by side with their ratio: the
before/after of a change in one run. A shared machine drifts by tens of
percent within minutes (measured: a stage neither tree changed came out at
0.61x when the baseline simply ran first), so the two take turns in
`--rounds` rounds ordered baseline-candidate, candidate-baseline, ... (a
linear drift falls on both alike), and each figure is the median over the
rounds of a round's median. Stages the baseline did not have (e.g. a skipped
pass) show as 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import peak_since, reset_peak, take_turns, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLOW_STAGES = ("rollout", "reward", "log_probs", "values")
STAGES = (*FLOW_STAGES, "advantages", "update", "transition", "other")
ALGOS = {
    "grpo": [],
    "ppo": ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95",
            "algorithm.skip_uniform_groups=false", "critic.optim.lr=1e-3", "critic.ppo_micro_batch_size=256",
            "reference.enabled=true", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01"],
}


def _timed(fn, sink: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)
    return wrapper


@contextlib.contextmanager
def _count_shipped(sink: list):
    """Count the tensor bytes every worker-group call delivers to its ranks, in any tree (the dispatch
    modes' split rules, which every tree's groups go through, are wrapped while this is open)."""
    from dataclasses import replace

    import torch
    from torch.utils._pytree import tree_leaves

    from hybridflow.controller import dispatch as D

    def counted(split):
        def wrapper(*args, **kwargs):
            per_rank = split(*args, **kwargs)
            sink.append(sum(t.nbytes for t in tree_leaves(per_rank) if isinstance(t, torch.Tensor)))
            return per_rank
        return wrapper

    rules = dict(D._MODES)
    D._MODES.update({mode: replace(rule, split=counted(rule.split)) for mode, rule in rules.items()})
    try:
        yield
    finally:
        D._MODES.update(rules)


def measure(algo: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    """Median seconds per stage over `steps` demo steps of `algo` (after `warmup`), and tokens/s."""
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.trainer import RLTrainer

    run_dir = tempfile.mkdtemp(prefix="bench_e2e_")
    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        *ALGOS[algo], f"trainer.total_steps={warmup + steps}", "trainer.val_every=0", "trainer.save_every=0",
        "trainer.val_before_train=false", f"trainer.output_dir={run_dir}", "trainer.loggers=[]", *overrides])
    trainer = RLTrainer(cfg)
    shipped: list[int] = []
    batch_time: list[float] = []
    transition: list[float] = []
    trainer.batch_stages = [_timed(stage, batch_time) for stage in trainer.batch_stages]
    trainer.weights.updated = _timed(trainer.weights.updated, transition)  # the switch to generation
    rows, base = [], None
    try:
        with _count_shipped(shipped):
            for step in range(1, warmup + steps + 1):
                if step == warmup + 1:
                    base = reset_peak()
                batch_time.clear()
                transition.clear()
                shipped.clear()
                metrics = trainer.train_step(step)
                if step <= warmup:
                    continue
                row = {name: metrics.get(f"timing/{name}_s", 0.0) for name in FLOW_STAGES}
                # Trees before the one log-prob call timed the reference and the old log-probs apart.
                row["log_probs"] += metrics.get("timing/reference_s", 0.0) + metrics.get("timing/old_log_probs_s", 0.0)
                row["shipped_mb"] = sum(shipped) / 1e6
                row["advantages"] = sum(batch_time)
                row["transition"] = sum(transition)
                row["update"] = metrics["timing/update_s"] - row["transition"]
                row["step"] = metrics["timing/step_s"]
                row["other"] = row["step"] - sum(row[name] for name in STAGES if name != "other")
                row["tokens"] = metrics["batch/tokens"]
                row["answer_tokens"] = metrics["response/length_mean"]
                rows.append(row)
        rise = peak_since(base)
    finally:
        trainer.shutdown()
    out = {name: statistics.median(r[name] for r in rows)
           for name in (*STAGES, "step", "tokens", "answer_tokens", "shipped_mb")}
    out["peak_mib"] = None if rise is None else base / 2**20 + rise
    out["tokens_per_s"] = statistics.median(r["tokens"] / r["step"] for r in rows)
    import hybridflow
    out["code"] = str(Path(hybridflow.__file__).parent)  # which tree was measured
    return out


def table(results: dict, baseline: dict | None, label: str) -> str:
    lines = []
    for algo, res in results.items():
        base = (baseline or {}).get(algo)
        head = f"{algo} step ({label})"
        if base:
            lines.append(f"{head:28s} {'before s':>9s} {'after s':>9s} {'after/before':>12s} {'share':>7s}")
        else:
            lines.append(f"{head:28s} {'s':>9s} {'share':>7s}")
        for name in (*STAGES, "step"):
            share = res[name] / res["step"] if res["step"] else 0.0
            if base:
                ratio = f"{res[name] / base[name]:11.2f}x" if base.get(name) else f"{'-':>12s}"
                lines.append(f"  {name:26s} {base.get(name, 0.0):9.4f} {res[name]:9.4f} {ratio} {share:7.1%}")
            else:
                lines.append(f"  {name:26s} {res[name]:9.4f} {share:7.1%}")
        if base:
            lines.append(f"  {'tokens/s':26s} {base['tokens_per_s']:9.0f} {res['tokens_per_s']:9.0f} "
                         f"{res['tokens_per_s'] / base['tokens_per_s']:11.2f}x")
            if base.get("shipped_mb"):
                lines.append(f"  {'MB shipped to ranks':26s} {base['shipped_mb']:9.2f} {res['shipped_mb']:9.2f} "
                             f"{res['shipped_mb'] / base['shipped_mb']:11.2f}x")
            if base.get("peak_mib") and res.get("peak_mib"):
                lines.append(f"  {'peak RSS MiB':26s} {base['peak_mib']:9.0f} {res['peak_mib']:9.0f} "
                             f"{res['peak_mib'] / base['peak_mib']:11.2f}x")
        else:
            lines.append(f"  {'tokens/s':26s} {res['tokens_per_s']:9.0f}")
            lines.append(f"  {'MB shipped to ranks':26s} {res['shipped_mb']:9.2f}")
            if res.get("peak_mib"):
                lines.append(f"  {'peak RSS MiB':26s} {res['peak_mib']:9.0f}")
    return "\n".join(lines)


def over_rounds(rounds: list[dict]) -> dict:
    """Per algorithm and figure, the median over rounds (each round's figures are medians over its steps)."""
    out = {}
    for algo in rounds[0]:
        figures = [r[algo] for r in rounds]
        out[algo] = {k: statistics.median(f.get(k, 0.0) for f in figures) if isinstance(v, (int, float)) else v
                     for k, v in figures[0].items()}
    return out


def run_baseline(rev: str, argv: list[str]) -> dict:
    """This script's measurement on a worktree of `rev`, in a subprocess importing that tree's hybridflow."""
    tree = Path(tempfile.mkdtemp(prefix="bench_e2e_base_")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    try:
        out = tree / "baseline.json"
        env = {**os.environ, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": ""}
        # The script itself is this one (the baseline may predate it); configs and code are the tree's.
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--root", str(tree), *argv,
                        "--json", str(out)], env=env, check=True, cwd=tree)
        return json.loads(out.read_text())["results"]
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main(argv: list[str] | None = None) -> int:
    global ROOT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per algorithm (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--algo", default="grpo,ppo", help="comma-separated: grpo, ppo")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--baseline", metavar="REV", help="measure git revision REV too, side by side")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --baseline: rounds in which the two take turns (ABBA order)")
    parser.add_argument("-o", "--override", action="append", default=[], help="a config override, KEY=VALUE")
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)  # the tree whose configs are used
    args = parser.parse_args(argv)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the demo runs on CPU (engine/cpu_compat.py)
    if args.root:
        ROOT = args.root.resolve()
    algos = [a for a in args.algo.split(",") if a]
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        parser.error(f"unknown --algo {unknown}; expected some of {sorted(ALGOS)}")
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--algo", args.algo,
              *[x for o in args.override for x in ("-o", o)]]
    if not args.baseline:
        baseline, results = None, {algo: measure(algo, args.steps, args.warmup, args.override) for algo in algos}
    else:
        seen = take_turns({"baseline": lambda: run_baseline(args.baseline, common),
                           "ours": lambda: {a: measure(a, args.steps, args.warmup, args.override) for a in algos}},
                          args.rounds)
        baseline, results = over_rounds(seen["baseline"]), over_rounds(seen["ours"])
    label = f"vs {args.baseline}" if args.baseline else "medians"
    print(table(results, baseline, label), flush=True)
    if args.json:
        write_json(args.json, {"results": results, "baseline": baseline, "baseline_rev": args.baseline,
                               "steps": args.steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
