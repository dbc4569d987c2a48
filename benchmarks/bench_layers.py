"""The CPU engine's layer kernels (RMSNorm, SwiGLU, RoPE) against megatron-core's unfused ops, side by side.

    hybridflow bench layers [--repeats 20] [--quick] [--json PATH]

1. Each kernel, forward + backward, against its PyTorch reference (the math megatron-core runs without
   apex or Transformer Engine): at the shapes of the demo's update (1224 tokens: hidden 128, ffn 384,
   4 heads of 32) and of a Qwen2.5-0.5B layer (2048 tokens: hidden 896, ffn 4864, 14 + 2 heads of 64).
2. The demo model's forward + backward on a batch of the demo's shape (64 prompts x 8 responses of up to
   6 tokens, shared-prompt rows, one micro-batch, as `make demo` updates early in its run): two engines in
   this process, `layer_kernels=True` and `False`, timed alternately, so that the machine's drift falls on
   both alike. Medians, and the ratio kernels / unfused.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"demo update": (1224, 128, 384, 4, 4, 32), "Qwen2.5-0.5B layer": (2048, 896, 4864, 14, 2, 64)}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and the extension's build)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _fwd_bwd(fn, *inputs):
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))


def bench_kernels(repeats: int, shapes: dict) -> list[dict]:
    from hybridflow.kernels import layers as L

    rows = []
    for label, (tokens, hidden, ffn, heads, kv_heads, head_dim) in shapes.items():
        g = torch.Generator().manual_seed(0)
        x, weight = torch.randn(tokens, 1, hidden, generator=g), torch.rand(hidden, generator=g) + 0.5
        fc1 = torch.randn(tokens, 1, 2 * ffn, generator=g)
        qkv = torch.randn(tokens, 1, heads + 2 * kv_heads, head_dim, generator=g)
        angles = torch.randn(tokens, 1, head_dim // 2, generator=g).repeat(1, 1, 2)
        cos, sin = angles.cos(), angles.sin()
        cases = {
            "rms_norm": (lambda a, w: L.rms_norm_reference(a, w, 1e-6), lambda a, w: L.rms_norm(a, w, 1e-6),
                         (x, weight)),
            "swiglu": (L.swiglu_reference, L.swiglu, (fc1,)),
            "rotary (q and k)": (lambda t: L.rotary_reference(t[:, :, :heads + kv_heads], cos, sin),
                                 lambda t: L.rotary(t[:, :, :heads + kv_heads], cos, sin), (qkv,)),
        }
        for name, (ref, fast, inputs) in cases.items():
            ref_ms = _median_ms(lambda: _fwd_bwd(ref, *inputs), repeats)
            fast_ms = _median_ms(lambda: _fwd_bwd(fast, *inputs), repeats)
            rows.append({"shape": label, "kernel": name, "unfused_ms": ref_ms, "kernel_ms": fast_ms})
            print(f"{label:20s} {name:18s} fwd+bwd {ref_ms:9.3f} {fast_ms:9.3f} {fast_ms / ref_ms:7.2f}x", flush=True)
    return rows


def demo_batch(prompts: int = 64, samples: int = 8, response: int = 6, seed: int = 0) -> dict:
    """Left-padded prompts of 7-11 tokens (of the demo's 16), each sampled `samples` times, and responses
    of 3-6 tokens; the rows of one prompt are consecutive, as the rollout returns them."""
    from hybridflow.data import fields as F

    g = torch.Generator().manual_seed(seed)
    width = 16
    prompt_len = torch.randint(7, 12, (prompts,), generator=g).repeat_interleave(samples)
    prompt_ids = torch.randint(3, 16, (prompts, width), generator=g).repeat_interleave(samples, 0)
    prompt_mask = (torch.arange(width)[None] >= (width - prompt_len)[:, None]).long()
    lengths = torch.randint(3, response + 1, (prompts * samples,), generator=g)
    response_mask = (torch.arange(response)[None] < lengths[:, None]).long()
    responses = torch.randint(3, 16, (prompts * samples, response), generator=g) * response_mask
    return {F.INPUT_IDS: torch.cat([prompt_ids * prompt_mask, responses], 1),
            F.ATTENTION_MASK: torch.cat([prompt_mask, response_mask], 1),
            F.RESPONSES: responses, F.RESPONSE_MASK: response_mask}


def bench_engine(repeats: int, prompts: int) -> dict:
    from hybridflow.config.schema import OptimConfig, ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.engine.distributed import init_process_group
    from hybridflow.models import DecoderConfig

    init_process_group("cpu")
    path = ROOT / "hybridflow" / "assets" / "demo_model"
    engines = {}
    for name, layer_kernels in (("unfused", False), ("kernels", True)):
        engine = MegatronEngine(DecoderConfig.from_pretrained(path), ParallelConfig(), OptimConfig(lr=1e-4),
                                layer_kernels=layer_kernels)
        engine.load_hf_checkpoint(str(path))
        engines[name] = engine
    batch = demo_batch(prompts)

    def step(engine):
        engine.run([batch], lambda out, mb: (out.float().pow(2).mean(), {}), share_prompts=True)
    times = {name: [] for name in engines}
    for name, engine in engines.items():
        step(engine)  # warm-up
    for _ in range(repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            step(engine)
            times[name].append(time.perf_counter() - start)
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"demo model fwd+bwd, {prompts} prompts x 8, shared-prompt rows: unfused {out['unfused']:.1f} ms, "
          f"kernels {out['kernels']:.1f} ms, {out['kernels'] / out['unfused']:.2f}x (medians of {repeats}, "
          f"alternating)", flush=True)
    return {"prompts": prompts, "unfused_ms": out["unfused"], "kernels_ms": out["kernels"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats, for a smoke run")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'shape':20s} {'kernel':18s} {'':7s} {'unfused ms':>9s} {'ours ms':>9s} {'ratio':>8s}")
    repeats = 3 if args.quick else args.repeats
    shapes = {"quick": (64, 32, 48, 2, 1, 16)} if args.quick else SHAPES
    result = {"kernels": bench_kernels(repeats, shapes), "engine": bench_engine(repeats, 4 if args.quick else 64)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
