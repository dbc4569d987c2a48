"""GPU benchmark suite: the kernel claims that need a GPU, measured side by side in one run.

    python benchmarks/gpu_suite.py [--quick] [--peak-tbps 4.8] [--only logprob,bandwidth,gae,generate]

Sections, each a table (read the ratios; these machines are noisy):
- logprob: token log-prob + entropy at 4096 x {32000, 151936}, bfloat16 and
  float32 logits, forward and forward+backward. Eager log_softmax + gather +
  entropy (the reference), the `chunked` PyTorch backend and the `cuda`
  kernel: median time from CUDA events, extra peak memory from
  torch.cuda.max_memory_allocated, and the largest |cuda - eager| over the
  outputs (and the logits gradient), so a fast wrong kernel cannot pass.
- bandwidth: the cuda forward and backward kernels alone (no autograd):
  bytes they must move / time, as a fraction of the device's peak HBM
  bandwidth (`--peak-tbps`; 4.8 for an H200).
- gae: GAE at B=64 x T in {512, 2048, 8192} on CUDA tensors: the reference
  loop on the GPU, the C++ scan on the host (device<->host copies included)
  and the `cuda` warp-scan kernel (what `auto` runs there).
- reshard: the checkpoint resharding tool (`hybridflow reshard`, CPU work
  on the GPU machine's host) on a Qwen2.5-0.5B-shaped model (all 24 layers,
  random bfloat16 weights): time and peak resident memory of each conversion
  against its dry run and a whole-model load + save (bench_reshard.py
  --tool's table). The dist_checkpointing rows need megatron-core (the
  .whl that gpu_check.sh installs); without it they are left out.

- rollout (when vLLM imports): the built-in engine against vLLM on a
  Qwen2.5-0.5B-shaped model (2 layers with --quick, else all 24; random
  bfloat16 weights pushed into vLLM as the trainer pushes them), sampled
  responses of up to 256 tokens: tokens/s of each (bench_rollout.py --engine
  vllm's table). Without vLLM the section says so and is skipped.

- generate: the built-in generator's decode paths on a Qwen2.5-0.5B-shaped
  model (all 24 layers, random bfloat16), 32 prompts x 8 samples = 256 rows,
  256 new tokens, keyed sampling: the eager Python loop (64 new tokens: it
  is launch-bound, ~25 s for 256), the static path replayed as a CUDA graph
  and as torch.compile(mode="reduce-overhead"), side by side: tokens/s, the
  first call's capture/compile time, peak memory; then the decode step alone
  against its HBM roofline (weights + the KV cache's whole capacity / peak
  bandwidth) and the eager keyed sampler's share. Without CUDA it runs the
  same code at --quick sizes on the CPU (static path eager), as a dry run.

The whole run takes a few minutes on one H200, well under 8, of which the
first JIT build of the CUDA extension is about one (cached afterwards).
Importable, and `--help` works, without CUDA; a run needs a CUDA device.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from hybridflow.kernels import gae, logprob_entropy, logprob_entropy_reference
from hybridflow.kernels.backend import BackendUnavailable, cuda_extension

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import gae_inputs, logprob_step  # noqa: E402  (shared with the CPU tables)

LOGPROB_FNS = {
    "eager": logprob_entropy_reference,
    "chunked": lambda x, y: logprob_entropy(x, y, backend="chunked"),
    "cuda": lambda x, y: logprob_entropy(x, y, backend="cuda"),
}


def time_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median GPU time of `fn()` in milliseconds, from CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra_mib(fn) -> float:
    """Peak bytes allocated during `fn()` beyond what was live before it, in MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _logprob_inputs(n: int, v: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, v, generator=g, device="cuda") * 3.0).to(dtype)
    return logits, torch.randint(0, v, (n,), generator=g, device="cuda")


def _max_diff(logits, labels, backward: bool) -> float:
    """Largest |cuda - eager| over logp, entropy and (with `backward`) the logits gradient."""
    outs = []
    for name in ("eager", "cuda"):
        x = logits.detach().clone().requires_grad_(backward)
        lp, ent = LOGPROB_FNS[name](x, labels)
        if backward:
            (lp.sum() + ent.sum()).backward()
        outs.append([lp.detach(), ent.detach()] + ([x.grad.float()] if backward else []))
        del x, lp, ent
    return max((a - b).abs().max().item() for a, b in zip(*outs))


def bench_logprob(shapes, dtypes, repeats: int) -> None:
    print(f"\n{'log-prob + entropy':36s} {'eager ms':>9s} {'chunk ms':>9s} {'cuda ms':>9s} {'eager/':>7s} "
          f"{'chunk/':>7s} {'eager MiB':>10s} {'chunk MiB':>10s} {'cuda MiB':>10s} {'max|diff|':>10s}")
    print(f"{'':36s} {'':>9s} {'':>9s} {'':>9s} {'cuda':>7s} {'cuda':>7s}")
    for n, v in shapes:
        for dtype in dtypes:
            for backward in (False, True):
                logits, labels = _logprob_inputs(n, v, dtype)
                logits.requires_grad_(backward)
                steps = {name: logprob_step(fn, logits, labels, backward) for name, fn in LOGPROB_FNS.items()}
                ms = {name: time_ms(step, repeats) for name, step in steps.items()}
                mib = {name: peak_extra_mib(step) for name, step in steps.items()}
                diff = _max_diff(logits, labels, backward)
                case = f"{n}x{v} {str(dtype).removeprefix('torch.')} {'fwd+bwd' if backward else 'fwd'}"
                print(f"{case:36s} {ms['eager']:9.3f} {ms['chunked']:9.3f} {ms['cuda']:9.3f} "
                      f"{ms['eager'] / ms['cuda']:6.1f}x {ms['chunked'] / ms['cuda']:6.1f}x "
                      f"{mib['eager']:10.0f} {mib['chunked']:10.0f} {mib['cuda']:10.0f} {diff:10.2e}", flush=True)
                del logits, labels, steps
                torch.cuda.empty_cache()


def bench_bandwidth(shapes, dtypes, repeats: int, peak_tbps: float) -> None:
    """HBM bandwidth of the kernels alone: forward reads logits once; backward reads them and writes the gradient."""
    ext = cuda_extension()
    print(f"\n{'cuda kernel bandwidth':36s} {'ms':>9s} {'GB moved':>9s} {'TB/s':>7s} {'of peak':>8s}"
          f"   (peak {peak_tbps} TB/s)")
    for n, v in shapes:
        for dtype in dtypes:
            logits, labels = _logprob_inputs(n, v, dtype)
            _, ent, lse = ext.logprob_entropy_forward(logits, labels)
            g = torch.ones(n, device="cuda")
            matrix = n * v * logits.element_size()
            cases = [  # (name, call, bytes): the [n, v] traffic plus labels and the per-row floats
                ("fwd", lambda: ext.logprob_entropy_forward(logits, labels), matrix + n * (8 + 3 * 4)),
                ("bwd", lambda: ext.logprob_entropy_backward(logits, labels, lse, ent, g, g),
                 2 * matrix + n * (8 + 4 * 4)),
            ]
            for name, call, nbytes in cases:
                ms = time_ms(call, repeats)
                tbps = nbytes / (ms * 1e-3) / 1e12
                case = f"{n}x{v} {str(dtype).removeprefix('torch.')} {name}"
                print(f"{case:36s} {ms:9.3f} {nbytes / 1e9:9.3f} {tbps:7.2f} {tbps / peak_tbps:7.0%}", flush=True)
            del logits, labels, ent, lse
            torch.cuda.empty_cache()


def bench_gae(lengths, repeats: int) -> None:
    print(f"\n{'gae B=64, CUDA tensors':36s} {'gpu ref ms':>11s} {'host C++ ms':>12s} {'cuda ms':>9s} "
          f"{'ref/cuda':>9s} {'max|diff|':>10s}")
    for t in lengths:
        r, v, m = gae_inputs(t, device="cuda")

        def reference():
            return gae(r, v, m, 0.99, 0.95, backend="reference")

        def via_host():
            adv, ret = gae(r.cpu(), v.cpu(), m.cpu(), 0.99, 0.95, backend="cpu")
            return adv.to("cuda"), ret.to("cuda")

        def kernel():
            return gae(r, v, m, 0.99, 0.95, backend="cuda")

        want = gae(r.double(), v.double(), m, 0.99, 0.95, backend="reference")
        diff = max((a.double() - b).abs().max().item() for a, b in zip(kernel(), want))
        ms = [time_ms(fn, repeats, warmup=1) for fn in (reference, via_host, kernel)]
        print(f"{f'T={t}':36s} {ms[0]:11.2f} {ms[1]:12.2f} {ms[2]:9.3f} {ms[0] / ms[2]:8.0f}x {diff:10.2e}",
              flush=True)


def write_qwen_shaped(path: Path, layers: int) -> Path:
    """A random HF checkpoint of Qwen2.5-0.5B's shapes (tools/make_qwen_shaped_model.py's config, bfloat16;
    no tokenizer: the tool converts weights only)."""
    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.checkpoint import save_hf_checkpoint
    from hybridflow.models.config import DecoderConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from make_qwen_shaped_model import QWEN25_05B

    cfg = DecoderConfig.from_hf_dict({**QWEN25_05B, "num_hidden_layers": layers})
    g = torch.Generator().manual_seed(0)
    hf = {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
          for name, shape in get_bridge(cfg).hf_shapes().items()}
    config = cfg.to_hf_dict()
    config["torch_dtype"] = "bfloat16"
    return save_hf_checkpoint(hf, config, path)


def bench_reshard_tool(quick: bool) -> None:
    import importlib.util
    import tempfile

    import bench_reshard

    if importlib.util.find_spec("megatron") is None:
        bench_reshard.TOOL_RUNS = tuple(r for r in bench_reshard.TOOL_RUNS if "dist" not in r[0])
        print("(megatron-core is not installed: the dist_checkpointing rows are left out)")
    with tempfile.TemporaryDirectory(prefix="gpu-suite-reshard-") as tmp:
        start = time.perf_counter()
        path = write_qwen_shaped(Path(tmp) / "qwen2.5-0.5b-shaped", 2 if quick else 24)
        print(f"\nreshard tool, Qwen2.5-0.5B-shaped ({'2' if quick else 'all 24'} layers, random bfloat16; "
              f"written in {time.perf_counter() - start:.0f} s)")
        bench_reshard.run_tool(argparse.Namespace(model=str(path), quick=quick))


def bench_rollout_engines(quick: bool) -> None:
    """The built-in engine against vLLM on the GPU, the way a rollout uses them (skipped without vLLM)."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("vllm") is None:
        print("\nrollout: vLLM is not installed (pip install 'hybridflow[vllm]'); the section is skipped")
        return
    import bench_rollout

    from hybridflow.models.checkpoint import load_decoder
    from hybridflow.rollout import Generator, hf_named
    from hybridflow.rollout.vllm_backend import VLLMBackend

    class Pad:
        pad_token_id = 0

    layers, prompt_len, new_tokens = (2, 64, 64) if quick else (24, 256, 256)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-rollout-") as tmp:
        path = write_qwen_shaped(Path(tmp) / "qwen2.5-0.5b-shaped", layers)
        decoder = load_decoder(path).to("cuda").eval()

        def make_vllm():
            engine = VLLMBackend(str(path), Pad(), dtype="bfloat16", device="cuda",
                                 max_model_len=prompt_len + new_tokens)
            engine.load_weights(hf_named(decoder))
            return engine

        print(f"\nrollout, Qwen2.5-0.5B-shaped ({layers} layers, random bfloat16), built-in engine against vLLM")
        bench_rollout.bench_vllm(Generator(decoder, pad_token_id=0), make_vllm, [8] if quick else [64, 256],
                                 prompt_len, new_tokens, 1 if quick else 3, eos_ids=64, workload="sampled")


def _qwen_shaped_decoder(layers: int, device: str):
    """A Qwen2.5-0.5B-shaped decoder with random bfloat16 weights, built where it runs (no checkpoint)."""
    from hybridflow.models.config import DecoderConfig
    from hybridflow.models.decoder import Decoder

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from make_qwen_shaped_model import QWEN25_05B

    cfg = DecoderConfig.from_hf_dict({**QWEN25_05B, "num_hidden_layers": layers})
    with torch.device(device):
        model = Decoder(cfg).to(torch.bfloat16).eval()
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return out, time.perf_counter() - start, peak


def bench_generate(quick: bool, peak_tbps: float) -> None:
    """The built-in generator's decode paths side by side (issue 30): the eager Python loop, the static
    path replayed as a torch.cuda.CUDAGraph and as torch.compile(mode="reduce-overhead"); tokens/s, the
    first call's capture / compile time, peak memory, and the decode step's time against the HBM roofline.
    Each mode's figures are printed before the next starts (reduce-overhead, the slowest to compile, last).
    On the CPU (a dry run of the same code) the static path runs eagerly and the roofline is left out."""
    from hybridflow.planner.cost import kv_cache_bytes
    from hybridflow.rollout import Generator, SamplingParams
    from hybridflow.rollout.sampling import sample
    from hybridflow.rollout.static_decode import bucket_size, cache_capacity, compiled_keyed_choice

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    layers, prompts, n, prompt_len, new_tokens, eager_tokens = (
        (2, 4, 4, 32, 24, 8) if quick else (24, 32, 8, 128, 256, 64))
    model = _qwen_shaped_decoder(layers, device)
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (prompts,), generator=g)
    mask = (torch.arange(prompt_len)[None] >= prompt_len - lengths[:, None]).long()
    ids = torch.randint(1, cfg.vocab_size, (prompts, prompt_len), generator=g) * mask
    keys = torch.arange(prompts) + 1000
    rows = prompts * n
    capacity, bucket = cache_capacity(prompt_len, new_tokens), bucket_size(rows)
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if name != "embed.weight" or cfg.tie_word_embeddings)  # the embedding lookup reads rows only
    kv_bytes = kv_cache_bytes(cfg, bucket * capacity, 2)  # the whole capacity of every row, bf16
    roofline_ms = (weight_bytes + kv_bytes) / (peak_tbps * 1e12) * 1e3
    print(f"\ngenerate, Qwen2.5-0.5B-shaped ({layers} layers, random bfloat16) on {device}: {prompts} prompts x {n} "
          f"= {rows} rows, prompts of {prompt_len // 2}-{prompt_len} tokens, keyed sampling at T=1, no EOS")
    print(f"decode step at batch {bucket}, cache capacity {capacity}: reads {weight_bytes / 1e9:.3f} GB of weights "
          f"+ {kv_bytes / 1e9:.3f} GB of KV (the whole capacity, as the masked attention does)"
          + (f": HBM roofline {roofline_ms:.3f} ms at {peak_tbps} TB/s" if cuda else ""))

    logits = torch.randn(bucket, cfg.vocab_size, device=device).to(torch.bfloat16)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=n)
    step_keys = torch.arange(bucket, device=device) * 1000
    draws = [("eager", lambda: sample(logits, sampling, None, step_keys))]
    if cuda:  # what capture="graph" runs: the keyed draw compiled, the rest of the sampler eager
        draws.append(("compiled draw", lambda: sample(logits, sampling, None, step_keys, compiled_keyed_choice())))
    for name, draw in draws:
        try:
            ms = time_ms(draw, 5) if cuda else _timed(draw)[1] * 1e3
            print(f"keyed sampling of {bucket} rows over {cfg.vocab_size} tokens, {name}: {ms:.3f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001 - a failed part must not hide the other figures
            print(f"keyed sampling, {name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    print(f"\n{'decode path':30s} {'new tok':>8s} {'1st call s':>11s} {'call s':>8s} {'tokens/s':>10s} "
          f"{'peak GiB':>9s} {'step ms':>8s} {'/roofline':>10s} {'same tokens':>12s}")
    modes = [("eager (python loop)", "python", "graph", eager_tokens)]
    modes += ([("static + CUDAGraph", "static", "graph", new_tokens),
               ("static + reduce-overhead", "static", "compile", new_tokens)] if cuda else
              [("static (eager on CPU)", "static", "eager", new_tokens)])
    reference = None
    for label, decode, capture, steps in modes:
        params = SamplingParams(max_new_tokens=steps, temperature=1.0, n=n)
        gen = Generator(model, pad_token_id=0, decode=decode, capture=capture)
        try:
            _, first, _ = _timed(lambda: gen.generate(ids, mask, params, row_keys=keys))
            out, secs, peak = _timed(lambda: gen.generate(ids, mask, params, row_keys=keys))
            step_ms = _replayed_step_ms(gen, bucket, prompt_len, steps, cuda) if decode == "static" else None
        except Exception as exc:  # noqa: BLE001 - one failed mode must not hide the others' figures
            print(f"{label:30s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            continue
        tokens = int(out.response_mask.sum())
        same = "-"  # keyed streams depend on max_new_tokens: the static paths are compared with each other only
        if decode == "static" and reference is None:
            reference, same = out, "(reference)"
        elif decode == "static":
            same = f"{(out.responses == reference.responses).float().mean():.1%}"
        step = "-" if step_ms is None else f"{step_ms:.3f}"
        ratio = f"{step_ms / roofline_ms:.1f}x" if cuda and step_ms is not None else "-"
        print(f"{label:30s} {steps:8d} {first:11.2f} {secs:8.2f} {tokens / secs:10.0f} {peak:9.2f} {step:>8s} "
              f"{ratio:>10s} {same:>12s}", flush=True)
        gen.static.release()  # Generator.release keeps the captured steps; the next mode starts clean
        del gen, out
        if cuda:
            torch.cuda.empty_cache()


def _replayed_step_ms(gen, bucket: int, prompt_len: int, steps: int, cuda: bool) -> float:
    """One decode step of the static path at `bucket` rows: the median of replays of its captured step."""
    st = gen.static.states[bucket]
    replays = min(32, steps - 1)

    @torch.no_grad()  # as generate() runs it: with grad on, the compiled step recompiles to trace a backward
    def replay_steps():
        st.step.fill_(1)
        st.pos.fill_(prompt_len)
        for _ in range(replays):
            st.replay()

    return (time_ms(replay_steps, 5, warmup=1) if cuda else _timed(replay_steps)[1] * 1e3) / replays


KERNEL_SECTIONS = {"logprob", "bandwidth", "gae"}


def run_kernel_sections(args, only: set[str]) -> int:
    """The CUDA sections; 1 (with the reason on stderr) without a CUDA device or extension."""
    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA device visible (torch.cuda.is_available() is False); "
              "run it on a GPU machine with a CUDA build of torch.", file=sys.stderr)
        return 1
    repeats = 3 if args.quick else args.repeats
    shapes = [(256, 4096), (64, 32000)] if args.quick else [(4096, 32000), (4096, 151936)]
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    start = time.perf_counter()
    try:
        cuda_extension()
    except BackendUnavailable as exc:
        print(f"gpu_suite: the CUDA extension does not build: {exc}", file=sys.stderr)
        return 1
    print(f"CUDA extension ready in {time.perf_counter() - start:.1f} s (JIT build on the first run, then cached)")
    if "logprob" in only:
        bench_logprob(shapes, dtypes, repeats)
    if "bandwidth" in only:
        bench_bandwidth(shapes, dtypes, repeats, args.peak_tbps)
    if "gae" in only:
        bench_gae([128] if args.quick else [512, 2048, 8192], min(repeats, 3))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats, a smoke run (~1 min)")
    parser.add_argument("--only", default="logprob,bandwidth,gae,reshard,rollout,generate,step",
                        help="comma-separated subset of the sections")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="device peak HBM bandwidth in TB/s (H200: 4.8)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (median reported)")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    start = time.perf_counter()
    if only & KERNEL_SECTIONS and run_kernel_sections(args, only) != 0:
        return 1
    if "reshard" in only:  # host work: runs (and is tried) without CUDA too
        bench_reshard_tool(args.quick)
    if "rollout" in only and torch.cuda.is_available():
        bench_rollout_engines(args.quick)
    if "generate" in only:  # on the CPU: a dry run of the same code at --quick sizes
        bench_generate(args.quick or not torch.cuda.is_available(), args.peak_tbps)
    if "step" in only:  # the 0.5B-shaped GRPO step stage by stage; on the CPU a small try of the same code
        import gpu_step

        gpu_step.print_report(gpu_step.run_step_bench(args.quick, args.peak_tbps))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
