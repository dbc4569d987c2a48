"""Rollout benchmark: the built-in Generator against HF `generate` on the same weights.

    python benchmarks/bench_rollout.py [--quick] [--threads N] [--workload greedy|sampled|turns|all] [--json PATH]
    python benchmarks/bench_rollout.py --engine vllm [--quick]      # vLLM against the built-in engine

`--engine vllm` (vLLM installed, e.g. `make test-vllm`'s .venv-vllm) runs vLLM
(`rollout/vllm_backend.py`, weights pushed from the same decoder) against
the built-in engine instead of HF, on the same prompts, keys and workloads:
tokens/s of each and their ratio, `same` (greedy), and memory: the resident
growth of building vLLM's engine with its KV cache (paid once) and each
engine's peak during one batch. The built-in engine runs first, before the
vLLM engine exists (see `bench_vllm`). On the CPU this measures vLLM's CPU
backend, which says little about what vLLM does on a GPU.

A small Llama-shaped model is built here with random weights, saved as an HF
checkpoint and loaded by `transformers`, so both engines run identical
float32 weights on the same left-padded prompts. Runs of the two alternate
and the median of `--repeats` is reported, since other processes on a shared
machine shift single timings. Two workloads:

- `greedy`: both generate exactly `--new-tokens` tokens per row (no EOS;
  `min_new_tokens` for HF). Every row does the same work, so this compares
  the decoding step itself. `same` is the fraction of generated tokens on
  which the two engines agree (greedy: they should be identical).
- `sampled`: what an RL rollout does. Temperature 1 over the full vocabulary,
  and `--eos-ids` of the tokens end a row, so with near-uniform random logits
  a row ends with probability eos_ids/vocab per step: lengths are geometric
  (mean about 64 at the defaults) and cut at `--new-tokens`, a long tail like
  real responses. Tokens are counted up to and including each row's EOS, for
  each engine from its own samples (the two draw different random numbers
  from the same distribution), and tokens/s is all tokens over all time of
  the `--repeats` rounds, so the runs' different lengths average out;
  `len ratio` is our mean length over HF's. `python` is our generator's
  Python decode loop (`decode="python"`; `ours` runs the C++ decode loop on
  the CPU) and `no-drop` that loop with ended rows kept in the batch (as HF
  keeps them), on the same keyed samples as `ours`: `vs python` is what the
  C++ loop gains, `vs no-drop` what it and dropping ended rows gain. The
  line's tail: `rollout/hf_generate.py`'s loop (the engine of models only
  `transformers` builds) on the HF model with `ours`' keys, its tokens/s and
  the share of rows it sampled exactly as `python` did.

- `turns`: multi-turn agent episodes on the built-in engine, the KV cache
  kept between turns against re-prefilling the whole trajectory at every
  turn (`rollout_turns.py`): prefill tokens and positions per episode and
  episode tokens/s of both paths, side by side in one run, and whether they
  made the same episodes. No HF row.

The first two workloads also report each engine's peak memory for one batch: how far
the process's resident high-water mark rises during one `generate` call
(`figures.py`; the KV cache, logits and buffers each engine allocates), and
`mem` = ours / HF (below 1: ours holds less). `--json PATH` writes the rows.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch

from hybridflow.models import Decoder, DecoderConfig, save_decoder
from hybridflow.rollout import Generator, SamplingParams
from hybridflow.rollout.hf_generate import HFGenerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (hybridflow bench runs this by path)
from figures import mib, peak_extra_mib, ratio, write_json  # noqa: E402
from rollout_turns import bench_turns, print_turns  # noqa: E402

# "small": a Llama-shaped model where the matrix multiplies dominate a step;
# "demo": the shape `make demo` generates with (hidden 128, 16-token vocab),
# where per-step overhead dominates, as it does for short RL responses.
SHAPES = {
    "small": dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=704,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-5, max_position_embeddings=2048),
    "demo": dict(model_type="llama", vocab_size=16, hidden_size=128, intermediate_size=384,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 rms_norm_eps=1e-6, max_position_embeddings=2048),
}
PAD = 0


def _prompts(batch: int, max_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts [batch, max_len] with lengths between max_len/2 and max_len."""
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(max_len // 2, max_len + 1, (batch,), generator=g)
    mask = (torch.arange(max_len)[None] >= max_len - lengths[:, None]).long()
    ids = torch.randint(1, vocab, (batch, max_len), generator=g) * mask
    return ids, mask


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _tokens_to_eos(responses: torch.Tensor, eos: tuple[int, ...]) -> int:
    """Tokens of each row up to and including its first EOS (all of them when none), summed."""
    ended = torch.isin(responses, torch.tensor(eos))
    first = torch.where(ended.any(1), ended.int().argmax(1) + 1, responses.shape[1])
    return int(first.sum())


def _peaks(ours_fn, hf_fn) -> tuple:
    """Peak resident MiB of one call of each engine, measured one after the other (no_grad, as generation)."""
    with torch.no_grad():
        return peak_extra_mib(ours_fn)[1], peak_extra_mib(hf_fn)[1]


def bench_sampled(ours: Generator, hf_model, batches, prompt_len: int, new_tokens: int,
                  repeats: int, eos_ids: int) -> list[dict]:
    import hybridflow.rollout.generator as generator_module

    vocab = ours.model.cfg.vocab_size
    eos = tuple(range(1, vocab, vocab // eos_ids))[:eos_ids]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=eos)
    hf_kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                     pad_token_id=PAD, eos_token_id=list(eos))
    drop_at = generator_module._COMPACT_AT
    python = Generator(ours.model, pad_token_id=PAD, decode="python")
    hf_loop = HFGenerator(hf_model, pad_token_id=PAD)  # the engine of models only transformers builds

    def ours_keyed(generator, ids, mask, keys, compact: bool = True):
        generator_module._COMPACT_AT = drop_at if compact else float("inf")
        try:
            return generator.generate(ids, mask, params, row_keys=keys)
        finally:
            generator_module._COMPACT_AT = drop_at

    rows = []
    for batch in batches:
        ids, mask = _prompts(batch, prompt_len, vocab)
        torch.manual_seed(0)
        names = ("ours", "python", "no-drop", "hf loop", "hf")
        tokens = dict.fromkeys(names, 0)
        seconds = dict.fromkeys(names, 0.0)
        same_loop = 0.0
        for i in range(repeats + 1):  # the first round is a warm-up
            keys = torch.arange(batch) + 1000 * i  # the same samples for all of ours
            runs = {}
            for name, call in (("ours", lambda: ours_keyed(ours, ids, mask, keys)),
                               ("python", lambda: ours_keyed(python, ids, mask, keys)),
                               ("no-drop", lambda: ours_keyed(python, ids, mask, keys, compact=False)),
                               ("hf loop", lambda: hf_loop.generate(ids, mask, params, row_keys=keys)),
                               ("hf", lambda: hf_model.generate(ids, attention_mask=mask, **hf_kwargs))):
                start = time.perf_counter()
                with torch.no_grad():
                    runs[name] = call()
                if i:
                    seconds[name] += time.perf_counter() - start
            assert torch.equal(runs["python"].responses, runs["no-drop"].responses)
            # the same keyed samples on transformers' code: equal but for a near-tie flipped by rounding
            same_loop += float((runs["hf loop"].responses == runs["python"].responses).all(1).float().mean()) if (
                runs["hf loop"].responses.shape == runs["python"].responses.shape) else 0.0
            counts = {name: int(runs[name].response_mask.sum()) for name in names[:4]}
            counts["hf"] = _tokens_to_eos(runs["hf"][:, prompt_len:], eos)
            if i:
                tokens = {k: tokens[k] + counts[k] for k in tokens}
        rate = {k: tokens[k] / seconds[k] for k in tokens}
        length = {k: tokens[k] / (batch * repeats) for k in tokens}
        peak_ours, peak_hf = _peaks(lambda: ours_keyed(ours, ids, mask, keys),
                                    lambda: hf_model.generate(ids, attention_mask=mask, **hf_kwargs))
        print(f"{batch:6d} {prompt_len:7d} {new_tokens:7d} {rate['ours']:10.0f} {rate['python']:10.0f} "
              f"{rate['no-drop']:10.0f} {rate['hf']:10.0f} {rate['ours'] / rate['hf']:7.2f}x "
              f"{rate['ours'] / rate['python']:9.2f}x {rate['ours'] / rate['no-drop']:9.2f}x "
              f"{length['ours'] / length['hf']:6.3f} {mib(peak_ours)} {mib(peak_hf)} {ratio(peak_ours, peak_hf)}"
              f"   mean length ours {length['ours']:.0f}, HF {length['hf']:.0f}; hf_generate.py loop "
              f"{rate['hf loop']:.0f} tok/s (ours {rate['ours'] / rate['hf loop']:.2f}x), same rows "
              f"{same_loop / (repeats + 1):.3f}", flush=True)
        rows.append({"workload": "sampled", "batch": batch, "tokens_per_s": rate, "mean_length": length,
                     "peak_mib": {"ours": peak_ours, "hf": peak_hf}, "hf_loop_same_rows": same_loop / (repeats + 1)})
    return rows


def bench(ours: Generator, hf_model, batches, prompt_len: int, new_tokens: int, repeats: int) -> list[dict]:
    vocab = ours.model.cfg.vocab_size
    params = SamplingParams(max_new_tokens=new_tokens, do_sample=False)
    hf_kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                     pad_token_id=PAD, eos_token_id=None)
    rows = []
    for batch in batches:
        ids, mask = _prompts(batch, prompt_len, vocab)
        out = ours.generate(ids, mask, params)  # warm-up of both, and the agreement check
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=mask, **hf_kwargs)[:, prompt_len:]
        assert out.responses.shape == ref.shape == (batch, new_tokens), (out.responses.shape, ref.shape)
        same = (out.responses == ref).float().mean().item()
        t_ours, t_hf = [], []
        for _ in range(repeats):
            t_ours.append(_time(lambda: ours.generate(ids, mask, params)))
            with torch.no_grad():
                t_hf.append(_time(lambda: hf_model.generate(ids, attention_mask=mask, **hf_kwargs)))
        t_ours, t_hf = statistics.median(t_ours), statistics.median(t_hf)
        tokens = batch * new_tokens
        peak_ours, peak_hf = _peaks(lambda: ours.generate(ids, mask, params),
                                    lambda: hf_model.generate(ids, attention_mask=mask, **hf_kwargs))
        print(f"{batch:6d} {prompt_len:7d} {new_tokens:7d} {tokens / t_ours:10.0f} {tokens / t_hf:10.0f} "
              f"{t_hf / t_ours:7.2f}x {same:6.3f} {mib(peak_ours)} {mib(peak_hf)} {ratio(peak_ours, peak_hf)}",
              flush=True)
        rows.append({"workload": "greedy", "batch": batch, "tokens_per_s": {"ours": tokens / t_ours,
                     "hf": tokens / t_hf}, "same": same, "peak_mib": {"ours": peak_ours, "hf": peak_hf}})
    return rows


def _measure(call, repeats: int) -> tuple[float, torch.Tensor, Optional[float]]:
    """(tokens/s over `repeats` calls after a warm-up, the warm-up's responses, peak MiB of one more call)."""
    first = call().responses
    tokens, seconds = 0, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        out = call()
        seconds += time.perf_counter() - start
        tokens += int(out.response_mask.sum())
    with torch.no_grad():
        peak = peak_extra_mib(call)[1]
    return tokens / seconds, first, peak


def bench_vllm(ours: Generator, make_vllm, batches, prompt_len: int, new_tokens: int, repeats: int,
               eos_ids: int, workload: str) -> list[dict]:
    """The built-in engine, then vLLM (`make_vllm()` builds it), on the same prompts and keys.

    Not alternated: a process holding a vLLM CPU engine runs other torch work slower (vLLM's CPU worker
    binds the OpenMP threads and turns `torch.set_num_threads` into a no-op), so the built-in engine is
    measured before the vLLM engine exists.
    """
    vocab = ours.model.cfg.vocab_size
    eos = tuple(range(1, vocab, vocab // eos_ids))[:eos_ids]
    kinds = ("greedy", "sampled") if workload == "both" else (workload,)
    cases = []
    for kind in kinds:
        params = (SamplingParams(max_new_tokens=new_tokens, do_sample=False) if kind == "greedy" else
                  SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=eos))
        for batch in batches:
            ids, mask = _prompts(batch, prompt_len, vocab)
            cases.append((kind, batch, ids, mask, params, torch.arange(batch)))
    builtin = [_measure(lambda: ours.generate(ids, mask, params, row_keys=keys), repeats)
               for _, _, ids, mask, params, keys in cases]
    engine, engine_mib = peak_extra_mib(make_vllm)
    print(f"vLLM engine built (KV cache included): {mib(engine_mib).strip()} MiB resident")
    vllm = [_measure(lambda: engine.generate(ids, mask, params, row_keys=keys), repeats)
            for _, _, ids, mask, params, keys in cases]
    rows = [{"engine_mib": engine_mib}]
    for (kind, batch, *_), ours_fig, vllm_fig in zip(cases, builtin, vllm):
        if batch == batches[0]:
            print(f"{kind}: at most {new_tokens} new tokens per row"
                  f"{'' if kind == 'greedy' else f', {eos_ids} EOS ids of {vocab}'}\n"
                  f"{'batch':>6s} {'prompt':>7s} {'builtin tok/s':>13s} {'vLLM tok/s':>11s} {'vLLM/builtin':>12s} "
                  f"{'same':>6s} {'builtin MiB':>11s} {'vLLM MiB':>9s} {'mem':>6s}")
        same = f"{(ours_fig[1] == vllm_fig[1]).float().mean().item():6.3f}" if kind == "greedy" else "-"
        print(f"{batch:6d} {prompt_len:7d} {ours_fig[0]:13.0f} {vllm_fig[0]:11.0f} {vllm_fig[0] / ours_fig[0]:11.2f}x "
              f"{same:>6s} {mib(ours_fig[2], 11)} {mib(vllm_fig[2])} {ratio(vllm_fig[2], ours_fig[2])}", flush=True)
        rows.append({"workload": kind, "batch": batch, "tokens_per_s": {"builtin": ours_fig[0], "vllm": vllm_fig[0]},
                     "peak_mib": {"builtin": ours_fig[2], "vllm": vllm_fig[2]}})
    return rows


def vllm_main(args, decoder: Decoder, cfg: DecoderConfig, batches, prompt_len, new_tokens, repeats) -> list[dict]:
    from hybridflow.rollout import hf_named
    from hybridflow.rollout.vllm_backend import VLLMBackend, import_vllm

    class Pad:
        pad_token_id = PAD

    vllm = import_vllm()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, vLLM {vllm.__version__}")
    print(f"model: llama, hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads "
          f"({cfg.num_kv_heads} kv), ffn {cfg.intermediate_size}, vocab {cfg.vocab_size}, float32")
    print("NOTE: vLLM's CPU backend on this machine; these figures say little about vLLM on a GPU.")
    with tempfile.TemporaryDirectory() as tmp:
        path = save_decoder(decoder, tmp)

        def make_vllm():
            engine = VLLMBackend(str(path), Pad(), dtype="float32", max_model_len=prompt_len + new_tokens)
            engine.load_weights(hf_named(decoder))
            return engine

        ours = Generator(decoder, pad_token_id=PAD)
        return bench_vllm(ours, make_vllm, batches, prompt_len, new_tokens, repeats, args.eos_ids, args.workload)


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few tokens, small batches, for a smoke run")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch intra-op threads (default: the CPUs this process may use)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64, help="longest prompt (shortest is half)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small", help="model shape (see SHAPES)")
    parser.add_argument("--workload", choices=("greedy", "sampled", "both", "turns", "all"), default="all",
                        help="greedy fixed-length decoding, RL-style sampling with EOS, both, multi-turn agent "
                             "episodes (kept cache against re-prefill), or all three")
    parser.add_argument("--turns", type=int, default=4, help="turns: model turns per episode")
    parser.add_argument("--eos-ids", type=int, default=64,
                        help="sampled: how many token ids end a row (P(end) per step ~ eos_ids/vocab)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="what the built-in engine is measured against: HF generate, or vLLM (installed)")
    parser.add_argument("--json", help="also write every row's figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    cfg = DecoderConfig.from_hf_dict(SHAPES[args.shape])
    decoder = Decoder(cfg).init_weights(std=0.02, seed=0).eval()
    batches = [int(b) for b in args.batches.split(",")]
    prompt_len, new_tokens, repeats = args.prompt_len, args.new_tokens, args.repeats
    if args.quick:
        batches, prompt_len, new_tokens, repeats = [1, 4], 16, 8, 1
    if args.engine == "vllm":
        rows = vllm_main(args, decoder, cfg, batches, prompt_len, new_tokens, repeats)
        if args.json:
            write_json(args.json, {"quick": args.quick, "engine": "vllm", "shape": args.shape, "rows": rows})
        return
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(save_decoder(decoder, tmp)).eval()
    ours = Generator(decoder, pad_token_id=PAD)

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"model: llama, hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads "
          f"({cfg.num_kv_heads} kv), ffn {cfg.intermediate_size}, vocab {cfg.vocab_size}, float32")
    memory = f"{'ours MiB':>9s} {'HF MiB':>9s} {'mem':>6s}"
    header = (f"{'batch':>6s} {'prompt':>7s} {'new':>7s} {'ours tok/s':>10s} {'HF tok/s':>10s} "
              f"{'speedup':>8s} {'same':>6s} {memory}")
    rows = []
    if args.workload in ("greedy", "both", "all"):
        print(f"greedy, exactly {new_tokens} new tokens per row\n{header}")
        rows += bench(ours, hf_model, batches, prompt_len, new_tokens, repeats)
    if args.workload in ("sampled", "both", "all"):
        print(f"sampled (temperature 1), {args.eos_ids} EOS ids of {cfg.vocab_size}, at most {new_tokens} "
              f"new tokens\n{'batch':>6s} {'prompt':>7s} {'new':>7s} {'ours tok/s':>10s} {'python':>10s} "
              f"{'no-drop':>10s} {'HF tok/s':>10s} {'vs HF':>8s} {'vs python':>10s} {'vs no-drop':>10s} "
              f"{'len ratio':>6s} {memory}")
        rows += bench_sampled(ours, hf_model, batches, prompt_len, new_tokens, repeats, args.eos_ids)
    if args.workload in ("turns", "all"):
        sizes = dict(prompts=2, n=2, prompt_len=16, turn_tokens=8, obs_len=12, stop_every=4) if args.quick else \
            dict(prompts=8, n=2, prompt_len=prompt_len, turn_tokens=48, obs_len=32, stop_every=16)
        row = bench_turns(decoder, turns=args.turns, repeats=repeats, **sizes)
        print_turns(row)
        rows.append(row)
    if args.json:
        write_json(args.json, {"quick": args.quick, "shape": args.shape, "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
