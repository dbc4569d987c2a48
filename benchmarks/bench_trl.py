"""The same tiny GRPO work in hybridflow and in TRL's GRPOTrainer, side by side on this machine.

    hybridflow bench trl --trl-python /path/to/venv/bin/python [--steps N] [--warmup W] [--json PATH]

The work (#14): a random Qwen2 of about 100k parameters with tied embeddings
and the demo's 16-token tokenizer, 2 prompts x 8 samples per step from the
demo's 3-digit additions, at most 64 new tokens, temperature 1, no KL, no
reference, one optimizer step per step (one PPO epoch over one mini-batch),
learning rate 1e-5, float32 on CPU. The reward is 1 when the answer's digits
are the sum. Both sides load the same checkpoint, written once into a
temporary directory.

TRL is not a dependency of hybridflow: give the Python of a virtual
environment that has it (`python -m venv V && V/bin/pip install torch==2.13.0
trl`, the CPU wheel first). This script runs there in a subprocess (`--side
trl`) and reports the median seconds of `Trainer.training_step` measured by a
callback (generation, scoring and the update: everything a step does), then
hybridflow's median `timing/step_s` in this process, and the ratio. Without
`--trl-python`, only hybridflow's side runs.

Mean answer lengths are printed beside the times: both sides sample the same
random model, so their answers have the same length distribution, but the
samples differ, and a step's cost follows its tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "hybridflow" / "assets"
PROMPTS, SAMPLES, NEW_TOKENS, LR = 2, 8, 64, 1e-5


def make_model(out: Path) -> None:
    """A random Qwen2 (tied embeddings, q/k/v biases) with the demo's tokenizer, seeded."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=16, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         torch_dtype="float32")
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / "demo_model" / name, out / name)


def n_params(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(path / "model.safetensors").values())


def hybridflow_side(model: Path, steps: int, warmup: int) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_e2e import measure

    overrides = [f"model.path={model}", "model.make_vocab_size_divisible_by=1",
                 f"data.train_batch_size={PROMPTS}", f"data.max_response_length={NEW_TOKENS}",
                 f"rollout.n={SAMPLES}", "rollout.temperature=1.0",
                 f"actor.ppo_mini_batch_size={PROMPTS}", f"actor.ppo_micro_batch_size={PROMPTS * SAMPLES}",
                 f"actor.log_prob_micro_batch_size={PROMPTS * SAMPLES}",
                 f"actor.optim.lr={LR}", "actor.optim.lr_schedule=constant", "actor.optim.min_lr=0",
                 "algorithm.skip_uniform_groups=false", "reference.enabled=false"]
    res = measure("grpo", steps, warmup, overrides)
    return {"step_s": res["step"], "answer_tokens": res["answer_tokens"],
            "stages": {k: res[k] for k in ("rollout", "log_probs", "advantages", "update", "transition", "other")}}


def trl_side(model: Path, steps: int, warmup: int) -> dict:
    """Run in the TRL virtual environment: GRPOTrainer on the same work, median training_step seconds."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = pq.read_table(DEMO / "arithmetic" / "train.parquet").to_pylist()
    data = Dataset.from_list([{"prompt": r["prompt"][0]["content"], "answer": r["reward_model"]["ground_truth"]}
                              for r in rows[:PROMPTS * (steps + warmup + 1)]])

    def reward(completions, answer, **_):
        return [float("".join(c for c in text if c.isdigit()) == want) for text, want in zip(completions, answer)]

    times: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    out_dir = tempfile.mkdtemp(prefix="bench_trl_")
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
                      gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS, temperature=1.0, beta=0.0,
                      num_iterations=1, learning_rate=LR, lr_scheduler_type="constant", max_steps=steps + warmup,
                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0,
                      dataloader_num_workers=0, disable_tqdm=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    import trl
    return {"step_s": statistics.median(times[warmup:]), "answer_tokens": statistics.mean(lengths[warmup:]),
            "trl": trl.__version__, "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", help="the Python of a virtual environment with trl installed")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "trl":
        print("RESULT " + json.dumps(trl_side(args.model, args.steps, args.warmup)), flush=True)
        return 0
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    model = Path(tempfile.mkdtemp(prefix="bench_trl_model_"))
    make_model(model)
    print(f"model: random Qwen2, {n_params(model):,} parameters (tied embeddings), {model}", flush=True)
    results = {}
    if args.trl_python:
        proc = subprocess.run([args.trl_python, str(Path(__file__).resolve()), "--side", "trl", "--model", str(model),
                               "--steps", str(args.steps), "--warmup", str(args.warmup)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"the TRL side failed (exit {proc.returncode}) in {args.trl_python}")
        results["trl"] = json.loads(lines[-1].removeprefix("RESULT "))
    results["hybridflow"] = hybridflow_side(model, args.steps, args.warmup)
    print(f"{'':12s} {'s/step':>8s} {'answer tokens':>14s}")
    for side, res in results.items():
        print(f"{side:12s} {res['step_s']:8.4f} {res['answer_tokens']:14.1f}")
    if "trl" in results:
        speedup = results["trl"]["step_s"] / results["hybridflow"]["step_s"]
        print(f"hybridflow is {speedup:.2f}x TRL {results['trl']['trl']} per step")
        results["speedup"] = speedup
    else:
        print("TRL's side not run: no --trl-python (a virtual environment with trl installed); no ratio")
    print("hybridflow stages (s): " + ", ".join(f"{k} {v:.4f}" for k, v in results["hybridflow"]["stages"].items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
