"""The C++ CPU extension at a git revision against this checkout's, alternated in one process.

    hybridflow bench csrc --baseline REV [--repeats 12] [--json PATH]

REV's `csrc/cpu/` is built (and cached, like the checkout's) and the two builds take turns, round after
round, on the same inputs (`kernels.backend.using_cpu_build`), so that the machine's drift falls on both
alike. Both builds must have the same functions (REV from after the layer kernels landed), except the
prefill: a build without it (before 2026-12-02) prefills in Python, as the generator did then.

- generate: the demo's rollout, 64 prompts x 8 samples at temperature 1.5, up to 6 new tokens, on the demo
  model: the built-in generator's prefill and its C++ decode loop. The two builds' responses must agree
  token for token (keyed sampling); the script reports whether they do and the largest log-prob gap.
- fwd+bwd: the demo model's forward and backward on a 64 x 8 shared-prompt batch through the megatron-core
  engine, whose norms, SwiGLU and RoPE run the build's layer kernels.
"""
from __future__ import annotations

import argparse
import json
import runpy
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "hybridflow" / "assets" / "demo_model"


def build_revision(rev: str):
    """REV's csrc/cpu, built as its own extension module (this checkout's build when the sources are the same),
    from a directory named by the sources' git tree, so that a second run finds it built."""
    from hybridflow.kernels.backend import CSRC, _cache_dir, build_cpu_extension

    def git(*args) -> bytes:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=True).stdout

    names = git("ls-tree", "--name-only", f"{rev}:csrc/cpu").decode().split()
    sources = {name: git("show", f"{rev}:csrc/cpu/{name}") for name in names}
    if all((CSRC / "cpu" / name).is_file() and (CSRC / "cpu" / name).read_bytes() == text
           for name, text in sources.items()) and len(names) == len(list((CSRC / "cpu").iterdir())):
        print(f"{rev}'s csrc/cpu is this checkout's: one build for both")
        return build_cpu_extension()
    out = _cache_dir() / "baseline_sources" / git("rev-parse", f"{rev}:csrc/cpu").decode().strip() / "cpu"
    out.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        if not (out / name).is_file() or (out / name).read_bytes() != text:
            (out / name).write_bytes(text)
    return build_cpu_extension(out, name="cpu_kernels_baseline")


def demo_prompts(prompts: int = 64):
    """The first `prompts` training prompts of the demo, tokenized and left-padded."""
    import pyarrow.parquet as pq

    from hybridflow.data.prompts import encode_prompts, left_pad, render_prompt
    from hybridflow.data.tokenizer import Tokenizer

    rows = pq.read_table(ROOT / "hybridflow" / "assets" / "arithmetic" / "train.parquet").slice(0, prompts)
    tokenizer = Tokenizer.from_path(str(DEMO_MODEL))
    chat = tokenizer.has_chat_template  # False for the demo model: the prompt is the message's text
    texts = [render_prompt(tokenizer, messages, chat) for messages in rows.column("prompt").to_pylist()]
    input_ids, mask = left_pad(encode_prompts(tokenizer, texts, chat), tokenizer.pad_token_id)
    return input_ids, mask, tokenizer


def alternate(builds: dict, fn, repeats: int) -> dict:
    """Median seconds of fn() under each build, the builds taking turns; and each build's last result."""
    from hybridflow.kernels.backend import using_cpu_build

    times, results = {name: [] for name in builds}, {}
    for round_ in range(repeats + 1):  # round 0 warms up
        for name, module in builds.items():
            with using_cpu_build(module):
                start = time.perf_counter()
                results[name] = fn()
                if round_:
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, metavar="REV", help="the git revision to compare with")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    from hybridflow.config.schema import OptimConfig, ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.engine.distributed import init_process_group
    from hybridflow.kernels.backend import build_cpu_extension
    from hybridflow.models import DecoderConfig
    from hybridflow.models.checkpoint import load_decoder
    from hybridflow.rollout import Generator, SamplingParams

    builds = {args.baseline: build_revision(args.baseline), "this checkout": build_cpu_extension()}
    ids, mask, tokenizer = demo_prompts(args.prompts)
    generator = Generator(load_decoder(DEMO_MODEL), tokenizer.pad_token_id, decode="cpu")
    params = SamplingParams(max_new_tokens=6, n=8, temperature=1.5, stop_token_ids=(tokenizer.eos_token_id,))
    keys = torch.arange(args.prompts) * 1_000_003  # one per prompt (keyed sampling)
    gen_s, outs = alternate(builds, lambda: generator.generate(ids, mask, params, row_keys=keys), args.repeats)
    base, ours = outs.values()
    same = torch.equal(base.responses, ours.responses)
    gap = (base.log_probs - ours.log_probs).abs().max().item() if same else float("nan")

    init_process_group("cpu")
    engine = MegatronEngine(DecoderConfig.from_pretrained(DEMO_MODEL), ParallelConfig(), OptimConfig(lr=1e-4))
    engine.load_hf_checkpoint(str(DEMO_MODEL))
    batch = runpy.run_path(str(Path(__file__).with_name("bench_layers.py")))["demo_batch"](args.prompts)
    step_s, _ = alternate(builds, lambda: engine.run([batch], lambda out, mb: (out.float().pow(2).mean(), {}),
                                                     share_prompts=True), args.repeats)
    print(f"{'medians of ' + str(args.repeats) + ', alternating':36s} {args.baseline:>14s} {'this checkout':>14s} "
          f"{'ratio':>7s}")
    rows = {"generate": gen_s, "fwd+bwd": step_s}
    for name, t in rows.items():
        before, after = t[args.baseline], t["this checkout"]
        print(f"{name:36s} {before * 1e3:11.1f} ms {after * 1e3:11.1f} ms {after / before:6.2f}x")
    print(f"same responses: {same}; largest log-prob gap {gap:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": args.baseline, "seconds": rows, "same_responses": same,
                                               "log_prob_gap": gap}, indent=1))


if __name__ == "__main__":
    main()
