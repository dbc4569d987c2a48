"""Controller benchmark: what one worker-group call costs beyond the work it does.

    python benchmarks/bench_controller.py [--calls N] [--rows R] [--world W] [--iteration STEPS] [--long-tail]
                                          [--json PATH]

A batch shaped like the demo's rollout batch (R rows x 14 tokens of int64 ids
plus a mask, and per-row lists of prompt strings and rewards) goes through
`group.call(Worker.method, batch)` on a Ray group of W CPU workers and on an in-process
LocalWorkerGroup. The worker method does nothing but time itself, so
`overhead = controller wall time - worker time` is the price of dispatch:
splitting, `ray.put`, the actor calls, `ray.get` and concatenation. Three
calls per variant: an argument-free ONE_TO_ALL (the RPC floor), a DP_SPLIT
returning nothing, and a DP_SPLIT returning a float [rows, 14] tensor (as a
log-prob pass does). Medians over N calls after 3 warm-ups. `driver MiB`
is how far the driver's resident high-water mark rose over those N calls
(`figures.py`): what splitting, packing and gathering hold at once, beside
the in-process group and the clone-send path as baselines (the workers' own
memory is in their processes).

`--iteration STEPS` also times real demo GRPO steps with the actor in a
one-process Ray group against the same steps in-process: the controller's
share of an iteration.

`--long-tail` times a rollout -> reward DataFlow with long-tail response
lengths in sync and async mode (see `measure_async_long_tail`).

`ray x2 put-all` is the same Ray group with every argument sent through
`ray.put` first; the default passes a rank's own chunk by value (Ray inlines
small ones) and puts only arguments that several ranks share. `ray x2
clone-send` sends each chunk the way the group did before, cloned and
pickled as torch tensors, instead of as numpy views of the batch (results
return the same way in both; `--rows 4096 --tokens 2048` shows the
difference on a 128 MiB batch, in time and in driver memory).

`--json PATH` writes every figure printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from hybridflow.controller import (Dispatch, LocalWorkerGroup, RayWorkerGroup, ResourcePool, Worker, init_ray,
                                   register)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import mib, peak_since, reset_peak, write_json  # noqa: E402

TOKENS = 14  # response tokens per row in the demo


class _Noop(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> float:
        start = time.perf_counter()
        return time.perf_counter() - start

    @register(Dispatch.DP_SPLIT)
    def consume(self, batch: dict) -> dict:
        start = time.perf_counter()
        return {"seconds": time.perf_counter() - start}

    @register(Dispatch.DP_SPLIT)
    def log_probs(self, batch: dict) -> dict:
        start = time.perf_counter()
        out = torch.zeros(batch["input_ids"].shape[0], batch["input_ids"].shape[1])
        return {"log_probs": out, "seconds": time.perf_counter() - start}


class _ClonedChunks(RayWorkerGroup):
    """The previous send path: each rank's chunk cloned, then pickled as torch tensors.

    Only the send path: results come back the current way (numpy views) in
    both variants, so the difference is what the driver saves on sending.
    """

    @staticmethod
    def _pack_args(per_rank):
        def clone(value):
            if isinstance(value, dict):
                return {k: clone(v) for k, v in value.items()}
            return value.clone() if isinstance(value, torch.Tensor) else value

        return [(tuple(clone(a) for a in args), kw) for args, kw in per_rank]


class _PutEveryArgument(RayWorkerGroup):
    """The alternative measured against: every non-scalar argument goes through ray.put."""

    @staticmethod
    def _put_once(per_rank):
        import ray

        def ref(value):
            return value if value is None or isinstance(value, (bool, int, float, str)) else ray.put(value)

        return [(tuple(ref(a) for a in args), {k: ref(v) for k, v in kw.items()}) for args, kw in per_rank]


def demo_batch(rows: int, tokens: int = TOKENS) -> dict:
    return {"input_ids": torch.randint(0, 16, (rows, tokens), dtype=torch.int64),
            "attention_mask": torch.ones(rows, tokens, dtype=torch.int64),
            "prompts": [f"What is {i} + {i}?" for i in range(rows)],
            "rewards": [float(i % 2) for i in range(rows)]}


def _worker_seconds(result) -> float:
    seconds = result if isinstance(result, list) else result["seconds"]
    return max(seconds)  # ranks run in parallel: the slowest one bounds the call


def _measure(call, calls: int) -> tuple[float, float, float | None]:
    """Median wall and worker seconds over `calls` calls after 3 warm-ups, and the driver's peak MiB over them."""
    walls, works, base = [], [], None
    for i in range(calls + 3):
        if i == 3:
            base = reset_peak()
        start = time.perf_counter()
        result = call()
        wall = time.perf_counter() - start
        if i >= 3:
            walls.append(wall)
            works.append(_worker_seconds(result))
        del result  # the mark is what one call holds, not one call's result kept beside the next call
    return statistics.median(walls), statistics.median(works), peak_since(base)


def measure_dispatch_overhead(calls: int = 20, rows: int = 256, world: int = 2, tokens: int = TOKENS) -> list[dict]:
    """One row per (group, call): controller wall ms, worker ms and the overhead ms, per call."""
    init_ray()
    batch = demo_batch(rows, tokens)
    rows_out = []
    pool = ResourcePool(list(range(world)), "cpu")
    groups = [(f"ray x{world}", RayWorkerGroup(_Noop, pool)),
              (f"ray x{world} put-all", _PutEveryArgument(_Noop, pool)),
              (f"ray x{world} clone-send", _ClonedChunks(_Noop, pool)),
              ("local x1", LocalWorkerGroup(_Noop, ResourcePool([0], "cpu")))]
    try:
        for name, group in groups:
            for label, call in (("ONE_TO_ALL ping()", lambda g=group: g.call(_Noop.ping)),
                                ("DP_SPLIT consume(batch)", lambda g=group: g.call(_Noop.consume, batch)),
                                ("DP_SPLIT log_probs(batch)", lambda g=group: g.call(_Noop.log_probs, batch))):
                wall, work, peak = _measure(call, calls)
                rows_out.append({"group": name, "call": label, "wall_ms": wall * 1e3, "worker_ms": work * 1e3,
                                 "overhead_ms": (wall - work) * 1e3, "driver_peak_mib": peak})
    finally:
        for _, group in groups:
            group.shutdown()
    return rows_out


def measure_iteration_overhead(steps: int = 20, warmup: int = 3) -> dict:
    """Median demo training step (GRPO, configs/demo.yaml) on a 1-process Ray group vs in-process.

    Both run the same steps with the same seeds, so the work is identical; the
    difference is what the controller adds per iteration (three DP_SPLIT calls:
    generate, log-probs, update, with their batches through Ray).
    """
    import tempfile
    from pathlib import Path

    from hybridflow.config.loader import load_config
    from hybridflow.trainer.trainer import RLTrainer

    root = Path(__file__).resolve().parents[1]
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        for launcher in ("local", "ray"):
            cfg = load_config(root / "configs/demo.yaml", [f"trainer.output_dir={tmp}", f"trainer.launcher={launcher}"])
            cfg.model.path = str(root / cfg.model.path)
            cfg.data.train_files = [str(root / f) for f in cfg.data.train_files]
            cfg.data.val_files = []
            trainer = RLTrainer(cfg)
            try:
                times = []
                for step in range(1, warmup + steps + 1):
                    start = time.perf_counter()
                    trainer.train_step(step)
                    times.append(time.perf_counter() - start)
                medians[launcher] = statistics.median(times[warmup:])
            finally:
                trainer.shutdown()
    local, ray_ = medians["local"], medians["ray"]
    return {"local_s": local, "ray_s": ray_, "overhead_s": ray_ - local, "fraction": (ray_ - local) / ray_}


def _rollout_chunks(generator, batch):
    from hybridflow.rollout import SamplingParams

    out = []
    for chunk_ids, new in batch:
        gen = generator.generate(chunk_ids, torch.ones_like(chunk_ids), SamplingParams(max_new_tokens=new),
                                 generator=torch.Generator().manual_seed(new))
        out.append(torch.cat([gen.prompts, gen.responses], 1))
    return out


@torch.no_grad()
def _score_chunks(scorer, batch):
    return [scorer(seqs)[:, -1].mean().item() for seqs in batch]


def measure_async_long_tail(prompts: int = 64, chunk: int = 4, seed: int = 0, repeats: int = 3,
                            launcher: str = "local") -> dict:
    """Async vs sync DataFlow wall time on a rollout with long-tail response lengths.

    rollout: the built-in generator on a random demo-shaped model; each chunk
    of `chunk` prompts generates max(its prompts' lengths) tokens, the lengths
    drawn from a log-normal (median 24, a few past 150). reward: a 4x larger
    model scores prompt+response in one forward pass. Each stage gets one
    torch thread, standing in for stages on separate devices: threads of this
    process (`launcher="local"`, where they also share Python's GIL) or a Ray
    worker process per stage (`launcher="ray"`, the flow's `--ray` mode). The
    same chunks run in both modes, so the outputs are identical; only the
    schedule differs.
    """
    from hybridflow.dataflow import DataFlow, Node
    from hybridflow.models import Decoder, DecoderConfig
    from hybridflow.rollout import Generator

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.distributions.LogNormal(torch.log(torch.tensor(24.0)), 0.9).sample((prompts,)).clamp(4, 192)
    small = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    big = dict(small, hidden_size=256, intermediate_size=768, num_hidden_layers=8)
    actor = Generator(Decoder(DecoderConfig.from_hf_dict(small)).init_weights(seed=1).eval(), pad_token_id=0)
    scorer = Decoder(DecoderConfig.from_hf_dict(big)).init_weights(seed=2).eval()
    ids = torch.randint(1, 512, (prompts, 16), generator=g)
    items = [(ids[i:i + chunk], int(lengths[i:i + chunk].max())) for i in range(0, prompts, chunk)]

    walls, finals, stages = {False: [], True: []}, {}, []
    for _ in range(repeats):  # alternate the modes; medians, as the machine is shared
        for mode in (False, True):
            r = Node("rollout", model=actor, forward_fn=_rollout_chunks)
            w = Node("reward", model=scorer, forward_fn=_score_chunks)
            result = DataFlow([r, w], [(r, w)]).run(items, async_execution=mode, min_batch=1, launcher=launcher)
            walls[mode].append(result.wall_s)
            finals[mode] = result.final
            if not mode:  # the stages' own time, measured where they do not overlap
                stages.append(result.timings)
    walls = {mode: statistics.median(times) for mode, times in walls.items()}
    assert finals[False] == finals[True], "async changed the results"
    return {"sync_s": walls[False], "async_s": walls[True], "speedup": walls[False] / walls[True],
            "lengths": lengths, "rollout_s": statistics.median(t["rollout"] for t in stages),
            "reward_s": statistics.median(t["reward"] for t in stages)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per row (14 in the demo)")
    parser.add_argument("--quick", action="store_true", help="5 calls per variant")
    parser.add_argument("--long-tail", action="store_true", help="also time async vs sync on a long-tail rollout")
    parser.add_argument("--iteration", type=int, default=0, metavar="STEPS",
                        help="also time STEPS demo training steps on Ray vs in-process")
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args()
    calls = 5 if args.quick else args.calls
    rows = measure_dispatch_overhead(calls=calls, rows=args.rows, world=args.world, tokens=args.tokens)
    print(f"machine: {os.cpu_count()} cores; batch {args.rows} rows x {args.tokens} tokens int64 (+ mask, 2 lists); "
          f"median of {calls} calls")
    print(f"{'group':>16s} {'call':<26s} {'wall ms':>9s} {'worker ms':>10s} {'overhead ms':>12s} {'driver MiB':>10s}")
    for r in rows:
        print(f"{r['group']:>16s} {r['call']:<26s} {r['wall_ms']:9.2f} {r['worker_ms']:10.3f} {r['overhead_ms']:12.2f} "
              f"{mib(r['driver_peak_mib'], 10)}")
    figures = {"rows": args.rows, "tokens": args.tokens, "calls": calls, "dispatch": rows}
    if args.long_tail:
        for launcher, where in (("local", "threads of one process"), ("ray", "a Ray process per stage")):
            lt = measure_async_long_tail(launcher=launcher)
            q = torch.quantile(lt["lengths"], torch.tensor([0.5, 0.9, 1.0])).tolist()
            ideal = lt["sync_s"] / max(lt["rollout_s"], lt["reward_s"])
            print(f"long-tail rollout, stages in {where} (response length p50/p90/max "
                  f"{q[0]:.0f}/{q[1]:.0f}/{q[2]:.0f}), {len(lt['lengths']) // 4} chunks of 4, median of 3: "
                  f"rollout {lt['rollout_s']:.2f} s + reward {lt['reward_s']:.2f} s of work (sync); "
                  f"sync {lt['sync_s']:.2f} s, async {lt['async_s']:.2f} s -> async {lt['speedup']:.2f}x faster "
                  f"(identical outputs; perfect overlap would give {ideal:.2f}x)", flush=True)
            figures.setdefault("long_tail", {})[launcher] = {k: v for k, v in lt.items() if k != "lengths"}
    if args.iteration:
        it = measure_iteration_overhead(steps=args.iteration)
        print(f"demo GRPO step (median of {args.iteration}): in-process {it['local_s'] * 1e3:.0f} ms, "
              f"Ray worker group {it['ray_s'] * 1e3:.0f} ms -> controller overhead "
              f"{it['overhead_s'] * 1e3:.0f} ms = {it['fraction']:.1%} of an iteration")
        figures["iteration"] = it
    if args.json:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
