"""Async scoring (`reward.async_scoring`): a slow reward scored chunk by chunk while the rollout generates the next
chunk, against scoring the whole batch after the rollout.

    python benchmarks/bench_scoring.py [--quick] [--sleep-ms 20] [--workers 0] [--rounds 3] [--json PATH]

Two measurements, the two sides alternating in rounds (the machine is shared):

- `rollout`: the rollout worker's call on its own (`Rollout.generate` on the demo
  model, then `RolloutScoring.finish`), `--prompts` prompts x `--n` samples in
  chunks of `--chunk` prompts; the reward sleeps `--sleep-ms` per row (on the
  guard's thread, or in `--workers` processes) before the arithmetic reward.
  Printed beside it: the generation alone and the scoring alone, and the best
  ratio overlap can reach, max(gen, score) / (gen + score).
- `step`: whole GRPO steps of configs/tiny-grpo.yaml (`RLTrainer.fit`, local
  launcher) with rollout.batch_size_per_device = `--chunk` and the same reward,
  `timing/step_s` of every step but the first, median over the rounds.

The ratio is async / sync (below 1: async is faster). Both sides score the same
rows to the same values (tests/rewards/test_async_scoring.py checks that).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from figures import take_turns, write_json  # noqa: E402

ASSETS = ROOT / "hybridflow" / "assets"
REWARD_NAME = "bench_scoring_sleepy"


def sleepy_reward(sleep_s: float):
    from hybridflow.rewards.arithmetic import arithmetic_reward

    def sleepy(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(sleep_s)
        return arithmetic_reward(data_source, solution_str, ground_truth, extra_info)
    return sleepy


def rollout_side(args, fn):
    """Seconds of one rollout + scoring call with and without overlap, and of each part alone."""
    from hybridflow.config.schema import DataConfig, RewardConfig, RolloutConfig
    from hybridflow.data.dataset import PromptDataset
    from hybridflow.roles.rollout import Rollout
    from hybridflow.roles.scoring import RolloutScoring, build_scorer
    from hybridflow.utils import load_hf_model

    model = load_hf_model(ASSETS / "demo_model")
    data = PromptDataset(DataConfig(max_prompt_length=16, apply_chat_template=False), model.tokenizer,
                         [ASSETS / "arithmetic" / "test.parquet"])
    prompts = data.collate([data[i] for i in range(args.prompts)])
    rollout = Rollout(RolloutConfig(n=args.n, temperature=1.0, batch_size_per_device=args.chunk), 6,
                      model.generator, model.tokenizer, world_size=1)
    scorer = build_scorer(RewardConfig(timeout_s=60, workers=args.workers), fn)
    scorer.guard.start()

    def once(overlap: bool):
        def run():
            scoring = RolloutScoring(scorer, "sleepy", overlap)
            started = time.perf_counter()
            out = rollout.generate(prompts, seed=1, on_part=scoring.add if overlap else None)
            scoring.finish(out)
            return time.perf_counter() - started
        return run

    def generate_only():
        started = time.perf_counter()
        rollout.generate(prompts, seed=1)
        return time.perf_counter() - started

    batch = rollout.generate(prompts, seed=1)

    def score_only():
        started = time.perf_counter()
        RolloutScoring(scorer, "sleepy").finish(dict(batch))
        return time.perf_counter() - started

    once(False)()  # warm up both paths
    once(True)()
    times = take_turns({"sync": once(False), "async": once(True), "generate": generate_only,
                        "score": score_only}, args.rounds)
    scorer.close()
    return {k: statistics.median(v) for k, v in times.items()}


def step_side(args, mode: str, out: Path) -> list[float]:
    """`timing/step_s` of the steps after the first of one tiny-grpo run with reward.async_scoring=`mode`."""
    import json

    from hybridflow.config.loader import load_config
    from hybridflow.trainer.trainer import RLTrainer

    cfg = load_config(ROOT / "configs" / "tiny-grpo.yaml", [
        f"trainer.output_dir={out}", f"reward.function={REWARD_NAME}", f"reward.workers={args.workers}",
        f"rollout.batch_size_per_device={args.chunk}", f"reward.async_scoring={mode}",
        f"data.train_batch_size={args.step_prompts}", f"trainer.total_steps={args.steps}",
        "trainer.val_every=0", "trainer.save_every=0", "trainer.loggers=[jsonl]"])
    cfg.trainer.plot = False
    cfg.model.path = str(ROOT / cfg.model.path)
    cfg.data.train_files = [str(ROOT / f) for f in cfg.data.train_files]
    cfg.data.val_files = [str(ROOT / f) for f in cfg.data.val_files]
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (out / "tiny-grpo" / "metrics.jsonl").read_text().splitlines()]
    return [r["timing/step_s"] for r in rows if "timing/step_s" in r and r.get("step", 0) > 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer prompts, rounds and steps")
    p.add_argument("--sleep-ms", type=float, default=20.0, help="the reward's cost per row")
    p.add_argument("--workers", type=int, default=0, help="reward.workers (0: the guard's thread)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--chunk", type=int, default=4, help="rollout.batch_size_per_device")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per tiny-grpo run")
    p.add_argument("--step-prompts", type=int, default=16, help="data.train_batch_size of the step runs")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.rounds, args.steps, args.step_prompts = 16, 2, 3, 8

    from hybridflow.rewards import register_reward

    fn = sleepy_reward(args.sleep_ms / 1000)
    register_reward(REWARD_NAME)(fn)
    r = rollout_side(args, fn)
    print(f"reward {args.sleep_ms:g} ms/row, workers {args.workers}; chunks of {args.chunk} prompts x {args.n}")
    print(f"rollout ({args.prompts} prompts): generate {r['generate']:.3f} s, score {r['score']:.3f} s, "
          f"sync {r['sync']:.3f} s, async {r['async']:.3f} s, async/sync {r['async'] / r['sync']:.3f} "
          f"(best possible {max(r['generate'], r['score']) / (r['generate'] + r['score']):.3f})")

    steps: dict[str, list[float]] = {"false": [], "true": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for mode in ("false", "true") if k % 2 == 0 else ("true", "false"):
                steps[mode] += step_side(args, mode, Path(tmp) / f"{mode}{k}")
    sync, async_ = statistics.median(steps["false"]), statistics.median(steps["true"])
    print(f"step (tiny-grpo, {args.step_prompts} prompts x 4, {len(steps['false'])} steps a side): "
          f"sync {sync:.3f} s, async {async_:.3f} s, async/sync {async_ / sync:.3f}")
    if args.json:
        write_json(args.json, {"rollout": r, "step": {"sync": sync, "async": async_, "steps": steps},
                               "args": {k: str(v) for k, v in vars(args).items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
