"""Peak memory per rank under FSDP2: frozen models at N = 1, 2, 4 ranks, and the actor's update (#42 item 5).

    hybridflow bench fsdp [--quick] [--ranks 1,2,4] [--layers 8] [--hidden 512] [--vocab 4096] [--json PATH]

One Llama-shaped model (random weights, float32, CPU, gloo), built here and
saved twice as HF checkpoints: a causal LM and a sequence classifier of the
same shape. For each N, one torchrun launch of N processes; each rank
measures, one after the other, four spans, each from before its model is
built to the end of its work:

- `reference`: `engine.fsdp.FSDPEngine` with optim=None (a frozen reference),
  loaded from the checkpoint, then the reference log-probs of its share of a
  batch;
- `reward`: the classifier under `reward.engine: fsdp`
  (`engine.fsdp_frozen.load_sharded_classifier`, built on meta, each rank
  reading its rows only), then its share of the pairs scored;
- `actor fsdp`: `FSDPEngine` with Adam, two PPO updates (its share of each
  mini-batch);
- `actor megatron`: megatron-core's `MegatronEngine` at dp = N with the
  distributed optimizer (`parallel.distributed_optimizer`), the same two
  updates on the same weights and rows.

The figure is the resident high-water mark (Linux VmHWM, reset through
/proc/self/clear_refs after freed memory has been handed back to the OS:
`benchmarks/figures.py`, as `bench update_memory` measures) above the
resident size before the span's model was built, in two parts: `load`
(building and loading, which also counts the checkpoint's mapped pages read),
then, from a mark reset after loading, the model in use (two short forward
passes; two PPO updates for the actor). The launch fixes glibc's mmap threshold
(MALLOC_MMAP_THRESHOLD_), so every large buffer is mapped and unmapped when
freed and the mark follows the live buffers rather than the heap's leftovers.
Shown is the largest over the ranks. `whole` is the model's parameter bytes;
`target` (issue 42) is 1.1/N of it plus one layer's weights gathered: for the
reward model a decoder layer (or the embedding, if larger), for `FSDPEngine`
the largest of a block's MLP, its attention and the embedding (its units when
the target was set); activations count against it too (the batch is one short
row per rank so that they stay small). The units are finer now (each linear
layer; the largest is the embedding or the output layer) and each is gathered
into its parameters, held once (`engine/fsdp_comm.py`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import peak_since, reset_peak, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "hybridflow" / "assets" / "tiny_reward_model"
SPANS = ("reference", "reference megatron", "reward", "reward hf", "actor fsdp", "actor megatron")


def model_config(args: argparse.Namespace):
    from hybridflow.models import DecoderConfig

    heads = max(1, args.hidden // 64)
    return DecoderConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 11 // 4, num_layers=args.layers, num_heads=heads,
                         num_kv_heads=heads, head_dim=args.hidden // heads, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2)


def write_checkpoints(args: argparse.Namespace, out: Path) -> dict:
    """The causal LM (out/lm) and the classifier (out/rm) of the bench's shape, and their sizes."""
    import torch
    import transformers

    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.checkpoint import save_hf_checkpoint
    from hybridflow.models.decoder import Decoder

    cfg = model_config(args)
    decoder = Decoder(cfg).init_weights(std=0.02, seed=0)
    save_hf_checkpoint(get_bridge(cfg).generation_to_hf(dict(decoder.state_dict())), cfg.to_hf_dict(), out / "lm")
    hf = {**cfg.to_hf_dict(), "architectures": ["LlamaForSequenceClassification"], "num_labels": 1,
          "pad_token_id": 0}
    config = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    torch.manual_seed(0)
    classifier = transformers.LlamaForSequenceClassification(config)
    classifier.save_pretrained(out / "rm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, out / "rm" / name)
    layer = sum(p.numel() * 4 for p in decoder.layers[0].parameters())
    embedding = decoder.embed.weight.numel() * 4
    return {"lm_bytes": sum(p.numel() * 4 for p in decoder.parameters()),
            "rm_bytes": sum(p.numel() * 4 for p in classifier.parameters()),
            "layer_bytes": layer, "embedding_bytes": embedding,
            # the target's unit for FSDPEngine (issue 42): the largest of a block's MLP, attention, the embedding
          "engine_unit_bytes": max(sum(p.numel() * 4 for p in decoder.layers[0].mlp.parameters()),
                                   sum(p.numel() * 4 for p in decoder.layers[0].attn.parameters()), embedding)}


def rl_batch(args: argparse.Namespace, rows: int):
    import torch

    from hybridflow.data import fields as F

    g = torch.Generator().manual_seed(1)
    t = r = args.tokens // 2
    responses = torch.randint(3, args.vocab, (rows, r), generator=g)
    mask = torch.ones(rows, r, dtype=torch.long)
    return {F.INPUT_IDS: torch.cat([torch.randint(3, args.vocab, (rows, t), generator=g), responses], 1),
            F.ATTENTION_MASK: torch.ones(rows, t + r, dtype=torch.long), F.RESPONSES: responses,
            F.RESPONSE_MASK: mask, F.OLD_LOG_PROBS: -8.0 + 0.1 * torch.randn(rows, r, generator=g),
            F.ADVANTAGES: torch.randn(rows, r, generator=g)}


def warm_args(args: argparse.Namespace) -> argparse.Namespace:
    """The warm-up model's shape: tiny, so that its spans cost little."""
    return argparse.Namespace(**{**vars(args), "layers": 1, "hidden": 64, "vocab": 256})


def rank_part(args: argparse.Namespace) -> None:
    """One rank of a launch: the spans on the tiny warm-up model, then measured on the bench's model, one
    after the other; rank 0 prints every rank's peaks. The warm-up takes the process's one-time costs
    (lazy imports, thread pools, autograd's and FSDP's first-use allocations: 40-100 MiB, measured) out
    of the first span measured. Each span is measured twice from the resident size before its model was
    built: `load` (build and load), then, from a mark reset after loading (the checkpoint's file is closed
    by then, so its mapped pages are no longer resident), `peak` (the work: what the model costs in use)."""
    import gc

    import torch.distributed as dist

    from hybridflow.parallel.process_group import init_process_group

    init_process_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    peaks = {}
    for warm in (True, False):
        measured = spans(warm_args(args) if warm else args, Path(args.dir) / ("warm" if warm else "."), rank, world)
        for name in SPANS:
            dist.barrier()
            base = reset_peak()
            work = measured[name]()  # build and load
            load = peak_since(base)
            reset_peak()
            work()
            peaks[name] = {"peak": peak_since(base), "load": load}
            del work
            gc.collect()
    every = [None] * world
    dist.all_gather_object(every, peaks)
    if rank == 0:
        print(json.dumps({"world": world, "peaks_mib": every}))
    dist.barrier()


def spans(args: argparse.Namespace, directory: Path, rank: int, world: int) -> dict:
    """Span name -> a function doing its work on the model of `args` saved in `directory`."""
    from hybridflow.config.schema import ActorConfig, OptimConfig, ParallelConfig, ReferenceConfig
    from hybridflow.data.batch import rows_for_plan, slice_rows
    from hybridflow.engine import MegatronEngine
    from hybridflow.engine.fsdp import FSDPEngine
    from hybridflow.engine.fsdp_frozen import load_sharded_classifier
    from hybridflow.roles import Actor, Reference
    from hybridflow.rollout.hf import load_hf_model

    cfg, lm, rm = model_config(args), directory / "lm", directory / "rm"
    rows = args.rows
    batch = rl_batch(args, rows)
    optim = OptimConfig(lr=1e-5)
    actor_cfg = ActorConfig(optim=optim, ppo_mini_batch_size=rows, ppo_micro_batch_size=args.micro)

    frozen_batch = rl_batch(argparse.Namespace(**{**vars(args), "tokens": 16}), 1)  # one short row per rank
    pair = [("1 + 1 =", " 2")]

    def reference(engine):
        engine.load_hf_checkpoint(lm)
        ref = Reference(ReferenceConfig(log_prob_micro_batch_size=1), engine)
        return lambda: [ref.compute_ref_log_probs(frozen_batch) for _ in range(2)]

    def reward(load):
        model = load(rm)
        return lambda: [model.score(pair, 1) for _ in range(2)]

    def update(engine):
        engine.load_hf_checkpoint(lm)
        actor = Actor(actor_cfg, engine)

        def work():
            for step in range(2):  # the first allocates gradients and Adam's moments, the second runs on them
                mine, steps = rows_for_plan(batch, actor.plan(rows, step=step, replicas=world)[rank])
                actor.update_share(mine, steps)
        return work

    # Each builds and loads its model and returns the work to measure on it.
    return {"reference": lambda: reference(FSDPEngine(cfg)),
            "reference megatron": lambda: reference(MegatronEngine(cfg, ParallelConfig())),
            "reward": lambda: reward(load_sharded_classifier), "reward hf": lambda: reward(load_hf_model),
            "actor fsdp": lambda: update(FSDPEngine(cfg, optim, total_steps=10)),
            "actor megatron": lambda: update(MegatronEngine(cfg, ParallelConfig(distributed_optimizer=True), optim,
                                                            total_steps=10))}


def launch(args: argparse.Namespace, world: int, directory: Path) -> dict:
    child = [a for a in (sys.argv[1:] if args.argv is None else args.argv)]
    if "--json" in child:
        i = child.index("--json")
        del child[i:i + 2]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    # A fixed mmap threshold: glibc then serves every large buffer by mmap and unmaps it when freed, so the
    # resident mark follows the live buffers (its default threshold rises after the first large frees, and
    # freed heap memory stays resident, so each block's gathered weights would pile up in the mark).
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), __file__, *child, "--part", "--dir", str(directory)],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the {world}-rank launch failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _peak(run: dict, span: str, metric: str) -> float:
    """The largest figure over the ranks (a resident mark may be None where /proc cannot reset it)."""
    values = [p[span][metric] for p in run["peaks_mib"]]
    return float("nan") if None in values else max(values)


def table(sizes: dict, runs: list[dict]) -> tuple[str, list[dict]]:
    """The two tables (frozen models; the actor's update) as text, and their rows."""
    mib = 2**20
    frozen = {"reference": ("reference megatron", sizes["lm_bytes"], sizes["engine_unit_bytes"]),
              "reward": ("reward hf", sizes["rm_bytes"], max(sizes["layer_bytes"], sizes["embedding_bytes"]))}
    rows = []
    lines = ["frozen models, two short forward passes after loading: peak MiB per rank (max over ranks) above the "
             "resident size before the model was built; whole-model = megatron-core at dp = N (reference) or "
             "reward.engine hf (reward), the whole model on each rank",
             f"{'model':10s} {'N':>2s} {'whole':>7s} {'fsdp':>7s} {'whole-model':>12s} {'fsdp/whole-model':>17s} "
             f"{'target':>7s} {'within':>7s} {'fsdp/(whole/N)':>15s} {'load fsdp':>10s} {'load whole-model':>17s}"]
    for name, (baseline, whole, unit) in frozen.items():
        for run in runs:
            n = run["world"]
            peak, base = _peak(run, name, "peak"), _peak(run, baseline, "peak")
            target = (1.1 * whole / n + unit) / mib
            row = {"model": name, "world": n, "whole_mib": whole / mib, "peak_mib": peak, "whole_model_peak_mib": base,
                   "fsdp_over_whole_model": peak / base, "target_mib": target, "within": peak <= target,
                   "load_mib": _peak(run, name, "load"), "load_whole_model_mib": _peak(run, baseline, "load")}
            rows.append(row)
            lines.append(f"{name:10s} {n:2d} {whole / mib:7.1f} {peak:7.1f} {base:12.1f} "
                         f"{row['fsdp_over_whole_model']:17.2f} {target:7.1f} {'yes' if row['within'] else 'no':>7s} "
                         f"{peak / (whole / mib / n):15.2f} {row['load_mib']:10.1f} {row['load_whole_model_mib']:17.1f}")
    lines += ["", "actor update, 2 PPO updates (Adam) after loading: peak MiB per rank (max over ranks)",
              f"{'N':>2s} {'fsdp':>7s} {'megatron dist-opt':>18s} {'fsdp/megatron':>14s}"]
    for run in runs:
        fsdp, mega = _peak(run, "actor fsdp", "peak"), _peak(run, "actor megatron", "peak")
        row = {"model": "actor", "world": run["world"], "fsdp_mib": fsdp, "megatron_mib": mega,
               "fsdp_over_megatron": fsdp / mega}
        rows.append(row)
        lines.append(f"{run['world']:2d} {fsdp:7.1f} {mega:18.1f} {fsdp / mega:14.2f}")
    return "\n".join(lines), rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model (6 layers, hidden 256, vocab 512) at N = 1, 2 (for the test)")
    p.add_argument("--ranks", default=None, help="comma-separated N to launch (default 1,2,4; --quick: 1,2)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8, help="rows of the batch (split over the ranks)")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="prompt + response positions per row")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a rank of a launch
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.ranks, args.layers, args.hidden, args.vocab = args.ranks or "1,2", 6, 256, 512
    args.ranks = args.ranks or "1,2,4"
    if args.part:
        rank_part(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        sizes = write_checkpoints(args, Path(tmp))
        write_checkpoints(warm_args(args), Path(tmp) / "warm")
        runs = [launch(args, int(n), Path(tmp)) for n in args.ranks.split(",")]
    text, rows = table(sizes, runs)
    cfg = model_config(args)
    print(f"Llama-shaped model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, float32, CPU, gloo; "
          f"updates on {args.rows} rows x {args.tokens} positions. Figures: the resident high-water mark (VmHWM, "
          f"large buffers mmapped so freed ones leave it) above the resident size before the model was built, MiB; "
          f"`load`: while building and loading (it also counts the checkpoint's mapped pages read). target = 1.1/N "
          f"x whole + one layer gathered (reference: max(a block's MLP, its attention, the embedding), "
          f"{sizes['engine_unit_bytes'] / 2**20:.1f} MiB; reward: max(layer "
          f"{sizes['layer_bytes'] / 2**20:.1f}, embedding {sizes['embedding_bytes'] / 2**20:.1f}) MiB)")
    print(text)
    if args.json:
        write_json(Path(args.json), {"config": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "vocab_size")},
                                     "sizes": sizes, "rows": rows})


if __name__ == "__main__":
    main()
