"""The Qwen2.5-0.5B-shaped GRPO step on one GPU, stage by stage (issue 30, item 2): `gpu_suite.py --only step`.

Writes a random checkpoint of Qwen2.5-0.5B's shapes (all 24 layers, bfloat16) with a tokenizer trained on
the GSM8K questions (tools/make_qwen_shaped_model.py) and GSM8K's train split as parquet
(tools/prepare_gsm8k.py), runs `configs/qwen2.5-0.5b-grpo-gsm8k.yaml` on one device for a few steps
(32 prompts x 8 samples x at most 256 new tokens), and prints from the run's own metrics, as medians over
the steps after the first (which compiles and captures):

- each stage's seconds and share of the step (rollout, reward, log-probs (reference and old in one
  pass), update, the rest; the rollout's share of the 3D-HybridEngine's transition beside it);
- generated tokens/s (response tokens of the batch / the rollout's seconds);
- the decode step against its HBM roofline: the rollout's seconds / the longest response (every row
  steps until the longest ends, so this includes the prefill: an upper bound on one step), against
  (bf16 weights + the KV cache read at the mean context) / the device's bandwidth;
- the update's model-FLOPs utilisation: 6 x parameters x real tokens x epochs / the update's seconds /
  the device's bf16 peak (the update also runs the optimizer and the gathers: a lower bound on its MFU).

GSM8K is the copy that ships in the tree (hybridflow/assets/gsm8k), so it travels to the GPU machine with
it. `--quick` (and any run without CUDA) is a small
CPU try of the same code: 2 layers, float32, 4 prompts x 2 samples x 16 tokens, 2 steps.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from hybridflow.data import gsm8k
from hybridflow.models.config import DecoderConfig
from hybridflow.planner.cost import kv_cache_bytes, total_params

ROOT = Path(__file__).resolve().parents[1]
H200_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100/H200 SXM


def run_step_bench(quick: bool, peak_tbps: float, peak_tflops: float = H200_BF16_TFLOPS) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import make_qwen_shaped_model
    import prepare_gsm8k

    from hybridflow.config.loader import load_config
    from hybridflow.trainer.trainer import RLTrainer

    cuda = torch.cuda.is_available()
    quick = quick or not cuda
    layers, prompts, n, new_tokens, steps = (2, 4, 2, 16, 2) if quick else (24, 32, 8, 256, 3)
    src = gsm8k.GSM8K_DIR
    with tempfile.TemporaryDirectory(prefix="gpu-step-") as tmp:
        tmp = Path(tmp)
        model = make_qwen_shaped_model.write(tmp / "model", layers, 4096, src, 0)
        prepare_gsm8k.convert(gsm8k.split_file(src, "train"), tmp / "train.parquet", "train")
        cfg = load_config(ROOT / "configs" / "qwen2.5-0.5b-grpo-gsm8k.yaml", [
            f"model.path={model}", f"data.train_files=[{tmp / 'train.parquet'}]", "data.val_files=[]",
            f"trainer.device={'cuda' if cuda else 'cpu'}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
            "trainer.n_devices=1", "actor.parallel.tp=1",
            f"data.train_batch_size={prompts}", f"rollout.n={n}", f"data.max_response_length={new_tokens}",
            f"actor.ppo_mini_batch_size={prompts}", f"trainer.total_steps={steps}", "trainer.save_every=0",
            "trainer.val_before_train=false", "trainer.val_every=0", "trainer.loggers=[jsonl]",
            f"trainer.output_dir={tmp / 'runs'}", "trainer.overwrite=true", "trainer.launcher=local"])
        trainer = RLTrainer(cfg)
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
        records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    records = [r for r in records if "timing/step_s" in r]
    shapes = {**make_qwen_shaped_model.QWEN25_05B, "num_hidden_layers": layers}
    report = step_report(records, shapes, cfg.actor.ppo_epochs, prompts * n, peak_tbps if cuda else 0.0,
                         peak_tflops if cuda else 0.0)
    report.update(device="cuda" if cuda else "cpu", dtype=cfg.model.dtype, layers=layers, rows=prompts * n,
                  max_new_tokens=new_tokens)
    return report


def step_report(records: list[dict], shapes: dict, epochs: int, rows: int, peak_tbps: float,
                peak_tflops: float) -> dict:
    """The stage table's figures from the trainer's metrics records (medians over the steps after the first)."""
    timed = records[1:] or records
    med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
    stages = sorted({k for r in timed for k in r if k.startswith("timing/") and k.endswith("_s")} -
                    {"timing/step_s", "timing/prepare_wall_s", "timing/overlap_s"})
    figures = {k.removeprefix("timing/").removesuffix("_s"): med(k) for k in stages}
    step = med("timing/step_s")
    figures["other"] = max(step - sum(figures.values()), 0.0)
    cfg = DecoderConfig.from_hf_dict(shapes)
    params = total_params(cfg, divisible_by=1)  # the HF model's own count: no vocabulary padding
    response_tokens = med("response/length_mean") * rows
    longest = max(med("response/length_max"), 1.0)
    rollout = figures.get("rollout", 0.0)
    prompt_len = max(med("batch/tokens") / rows - med("response/length_mean"), 0.0)
    kv_bytes = kv_cache_bytes(cfg, rows * (prompt_len + longest / 2), 2)  # bf16, at the mean context
    roofline_s = (2 * params + kv_bytes) / (peak_tbps * 1e12) if peak_tbps else 0.0
    decode_step = rollout / longest
    update_flops = 6 * params * med("batch/tokens") * epochs
    return {"stages": figures, "step_s": step, "transition_s": med("reshard/time_s"),
            "tokens_per_s": response_tokens / rollout if rollout else 0.0,
            "decode_step_ms": decode_step * 1e3, "roofline_ms": roofline_s * 1e3,
            "vs_roofline": decode_step / roofline_s if roofline_s else None,
            "update_mfu": (update_flops / figures["update"] / (peak_tflops * 1e12)
                           if peak_tflops and figures.get("update") else None),
            "params": params}


def print_report(report: dict) -> None:
    print(f"\nGRPO step, Qwen2.5-0.5B-shaped ({report['layers']} layers, {report['dtype']}, "
          f"{report['params'] / 1e6:.0f}M parameters), {report['rows']} rows x <= {report['max_new_tokens']} new "
          f"tokens, on {report['device']}")
    step = report["step_s"]
    print(f"  {'stage':14s} {'s':>8s} {'share':>7s}")
    for name, seconds in report["stages"].items():
        print(f"  {name:14s} {seconds:8.3f} {seconds / step:7.1%}")
    print(f"  {'step':14s} {step:8.3f}")
    print(f"  the rollout includes the 3D-HybridEngine's transition: {report['transition_s']:.3f} s")
    print(f"  generated tokens/s {report['tokens_per_s']:,.0f}")
    line = f"  decode step (rollout / longest response) {report['decode_step_ms']:.2f} ms"
    if report["vs_roofline"]:
        line += f", HBM roofline {report['roofline_ms']:.3f} ms: {report['vs_roofline']:.1f}x it"
    print(line)
    if report["update_mfu"] is not None:
        print(f"  update MFU {report['update_mfu']:.1%} (6 N tokens x epochs / update s / bf16 peak)")
