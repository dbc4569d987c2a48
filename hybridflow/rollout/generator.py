"""The built-in rollout engine: batched generation with a KV cache on the plain `Decoder`.

    gen = Generator(decoder, pad_token_id=tok.pad_token_id, tokenizer=tok)
    out = gen.generate(input_ids, attention_mask, SamplingParams(max_new_tokens=256, n=4))

Prompts come left-padded; each is prefilled once and its cache rows shared by its `n` samples. Every
decode step runs the live rows together. Ended rows are fed padding until they are `_COMPACT_AT` of the
batch, then dropped from the batch and the KV cache in one copy, so a long tail of responses costs the
rows still running, not the whole batch. Greedy and keyed sampling (`row_keys`) give the same tokens
either way; a `torch.Generator` draws for the live rows only, so its samples depend on when rows are
dropped (still reproducible for the same inputs). Stop strings are the one per-row Python check.

Weights are read from the model's parameters at each call (the hybrid engine hands over views of the
training weights). As a `backend.RolloutBackend`, `load_weights` copies (HF name, tensor) pairs in
through the bridge, for a rollout group apart that holds its own copy; `release` and `resume` free
nothing.

Decode paths (`decode`): on the CPU the prefill and the decode steps run in two C++ calls
(`csrc/cpu/decode.cpp`) instead of ~100 Python-dispatched ops a step, the prefill skipping left
padding; they run only where they compute what the loop here does (float32, TP size 1, full attention,
greedy or keyed sampling, no top-k / top-p / stop strings) and agree with it to float rounding. On
CUDA the static-shape path of `static_decode.py` replays one captured step per token (this loop's
tokens; stop strings take this loop). `prefill` and `decode_after`, the eager path's two halves, also
serve the agent loop's cache kept between turns (`turns.py`); `prefill_tokens` and `prefill_positions`
count their prefill work (real tokens; positions computed, padding included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from hybridflow.models.bridge import get_bridge
from hybridflow.models.decoder import Decoder
from hybridflow.models.kv_cache import KVCache
from hybridflow.rollout.sampling import SamplingParams, sample
from hybridflow.rollout.static_decode import StaticDecoder

# Tokens decoded per stop-string check, per character of the longest stop
# string: a character can span several byte-level tokens.
_TOKENS_PER_CHAR = 4
# Drop ended rows from the decode batch once they are this fraction of it:
# each drop copies the live KV cache once, each ended row kept costs a row of
# every matmul and of attention per step.
_COMPACT_AT = 0.25


@dataclass
class GenerationOutput:
    """B*n rows, prompt-major (prompt 0 x n, prompt 1 x n, ...)."""
    prompts: torch.Tensor        # [B*n, T] long, left-padded
    prompt_mask: torch.Tensor    # [B*n, T] long
    responses: torch.Tensor      # [B*n, R] long, right-padded with pad_token_id; R = longest response
    response_mask: torch.Tensor  # [B*n, R] long, 1 on generated tokens including the EOS
    log_probs: torch.Tensor      # [B*n, R] float32, log-prob of each chosen token, 0 on padding


class Generator:
    """decode: "auto" (on CUDA the static-shape path of `static_decode`, on the CPU the C++ decode loop
    where it applies, see the module doc), "cpu" (the C++ loop, or an error saying why not), "static"
    (the static path on any device; eager on the CPU, for tests) or "python" (always the loop here).
    capture: how the static path replays its step on CUDA: "graph" (torch.cuda.CUDAGraph),
    "compile" (torch.compile, mode="reduce-overhead") or "eager"."""

    def __init__(self, model: Decoder, pad_token_id: int, tokenizer: Any = None, decode: str = "auto",
                 capture: str = "graph"):
        if decode not in ("auto", "cpu", "python", "static"):
            raise ValueError(f"decode must be 'auto', 'cpu', 'static' or 'python', got {decode!r}")
        self.model = model
        self.pad_token_id = pad_token_id
        self.tokenizer = tokenizer  # anything with .decode(list[int]) -> str; needed for stop strings
        self.decode = decode
        self.static = StaticDecoder(model, capture)  # captures nothing until the static path runs
        self.static_failed: Optional[str] = None  # why "auto" stopped taking the static path, if it did
        # Prefill work so far (`prefill`): real tokens, and positions computed (padding included where run).
        self.prefill_tokens = self.prefill_positions = 0

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (HF name, tensor) pairs into the model, in place; the bytes taken.

        The parts of a fused tensor (q/k/v, gate/up) may come in any order and bucket: each entry is
        fused and copied once its last part arrives. A name the model does not have, or an entry left
        incomplete, is a KeyError naming it.
        """
        if self.model.parallel.size > 1:
            raise ValueError("load_weights takes whole HF tensors; this generator holds a tensor-parallel shard")
        taken, tied = 0, self.model.cfg.tie_word_embeddings

        def counted():  # a tied checkpoint's copy of the embedding is skipped, not taken
            nonlocal taken
            for name, tensor in named:
                if not (tied and name == "lm_head.weight"):
                    taken += tensor.numel() * tensor.element_size()
                yield name, tensor

        params = dict(self.model.named_parameters())
        for name, fused in get_bridge(self.model.cfg).fuse_stream(counted()):
            params[name].copy_(fused)
        return taken

    def release(self) -> None:
        """Nothing freed: the weights are the model's, and the static path's caches and captured steps stay
        (recapturing every bucket each rollout would cost more than the cache's memory, a few GiB at
        256 rows of a 0.5B model; `self.static.release()` frees them). Steps captured on weights the
        3D-HybridEngine freed and allocated again are dropped at the next call (their storage moved)."""

    def resume(self) -> None:
        """Nothing to take back (see `release`)."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: Optional[torch.Generator] = None,
                 row_keys: Optional[torch.Tensor] = None) -> GenerationOutput:
        """Sample up to `params.max_new_tokens` tokens after each left-padded prompt [B, T].

        Reproducible: the same inputs and the same `generator` state give the same output.
        row_keys [B] (int64, one per prompt): sample with noise hashed from
        (row_keys[i], sample j, step) instead of `generator`, so a prompt's
        samples are the same whatever batch or rank it is generated in.
        """
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: Generator(model, pad_token_id, tokenizer)")
        n, steps = params.n, params.max_new_tokens
        b, t = input_ids.shape
        # Computed where the model lives, returned where the prompts came from (the
        # controller's batches are CPU tensors; a CUDA model generates on its GPU).
        rows, device, home = b * n, self.model.embed.weight.device, input_ids.device
        if self._static_applies(params, device):
            try:
                return self._static_generate(input_ids, attention_mask, params, generator, row_keys)
            except Exception as exc:  # noqa: BLE001 - "auto" must still generate; "static" raises
                # In a tensor-parallel group one rank falling back alone would issue other collectives than
                # its peers (a hang), so there the failure stops the call.
                if self.decode == "static" or getattr(self.model.parallel, "size", 1) > 1:
                    raise
                from hybridflow.kernels.backend import warn_once

                warn_once(f"the static decode path failed, decoding eagerly from now on: {type(exc).__name__}: {exc}")
                self.static.release()
                self.static_failed = f"{type(exc).__name__}: {exc}"
        fused = self._decode_extension(params, row_keys is not None, device)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        cache = KVCache(self.model.cfg, rows, t + steps, self.model.embed.weight.dtype, device)
        logits = self.prefill(fused, input_ids, attention_mask, cache, n)
        tokens, log_probs, mask, length = self.decode_after(fused, logits, cache, params, generator,
                                                            row_streams(row_keys, n, steps, device))
        return generation_output(input_ids, attention_mask, n, home, tokens, log_probs, mask, length)

    def prefill(self, fused, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: KVCache,
                n: int = 1) -> torch.Tensor:
        """Append left-padded `input_ids` [b, t] to `cache` (its rows: each of the b inputs n times on an empty
        cache, else one each); the logits [b * n, V] after each input's last token. `fused`: the C++ module
        (`_decode_extension`) or None. Counts `prefill_tokens` (real tokens) and `prefill_positions`
        (the positions computed: the C++ prefill skips padding, `forward_cached` does not)."""
        real = int(attention_mask.sum())
        # An extension built from sources before the C++ prefill (`bench csrc --baseline`) prefills in Python.
        if fused is not None and hasattr(fused, "prefill") and cache.length == 0 and bool(attention_mask[:, -1].all()):
            logits = self._fused_prefill(fused, input_ids, attention_mask, cache, n)
            self.prefill_positions += real
        else:
            logits = self.model.forward_cached(input_ids, cache, attention_mask, last_only=True)[:, -1]
            self.prefill_positions += input_ids.numel()
        self.prefill_tokens += real
        return logits.repeat_interleave(n, 0) if n > 1 else logits

    def decode_after(self, fused, logits: torch.Tensor, cache: KVCache, params: SamplingParams, generator,
                     keys: Optional[torch.Tensor], compact: bool = True):
        """The decode steps after a prefill (C++ loop when `fused`, else the Python one): tokens, log_probs,
        mask [rows, max_new_tokens] and the steps run. compact=False keeps ended rows in the cache (fed
        padding; the Python loop drops them otherwise), for a cache kept past this call."""
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=logits.device)
        if fused is not None:
            return self._fused_decode(fused, logits, cache, params, keys, stop_ids)
        return self._python_decode(logits, cache, params, generator, keys, stop_ids, compact)

    def _static_applies(self, params: SamplingParams, device: torch.device) -> bool:
        """The static path: asked for, or "auto" on CUDA; never for stop strings (they need the host each step)."""
        if self.decode == "static" and params.stop:
            raise ValueError("decode='static' cannot run stop strings: they are checked on the host each step")
        return self.decode == "static" or (self.decode == "auto" and device.type == "cuda" and not params.stop
                                           and self.static_failed is None)

    def _static_generate(self, input_ids, attention_mask, params: SamplingParams, generator, row_keys):
        """`generate` on the static path. Sampling without row_keys draws one key per prompt from `generator`
        (or the global generator), so every draw happens inside the captured step."""
        n, steps, device, home = params.n, params.max_new_tokens, self.model.embed.weight.device, input_ids.device
        b = input_ids.shape[0]
        if row_keys is None and not params.greedy:
            row_keys = torch.randint(0, 2 ** 40, (b,), generator=generator,
                                     device=generator.device if generator is not None else "cpu")
        keys = row_streams(row_keys, n, steps, device)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        tokens, log_probs, mask, length = self.static.generate(input_ids, attention_mask, params, keys, stop_ids,
                                                               self.pad_token_id)
        return generation_output(input_ids, attention_mask, n, home, tokens, log_probs, mask, length)

    def _python_decode(self, logits, cache: KVCache, params: SamplingParams, generator, keys, stop_ids,
                       compact: bool = True):
        """The decode steps after the prefill, one batch of torch ops each (`decode_loop` on this model's
        `forward_cached`): tokens, log_probs, mask [rows, max_new_tokens] and the number of steps run."""
        return decode_loop(logits, params, generator, keys, stop_ids, self.pad_token_id, self.tokenizer,
                           lambda token: self.model.forward_cached(token[:, None], cache)[:, -1],
                           cache.keep_rows if compact else None)

    def _decode_extension(self, params: SamplingParams, keyed: bool, device: torch.device):
        """The C++ decode loop's module when it computes this call exactly as the Python loop, else None."""
        if self.decode == "python":
            return None
        model = self.model
        why = None
        if device.type != "cpu" or model.embed.weight.dtype != torch.float32:
            why = "it runs float32 models on the CPU"
        elif model.parallel.size > 1 or any(w is not None for w in model.cfg.layer_windows):
            why = "it runs tensor-parallel size 1 with full attention"
        elif model.cfg.qk_norm or model.cfg.is_moe:
            why = "it runs dense models without QK-norm (Llama, Qwen2, Mistral)"
        elif params.stop or params.top_k > 0 or params.top_p < 1:
            why = "it has no stop strings, top-k or top-p"
        elif not params.greedy and not keyed:
            why = "it samples greedily or with row_keys, not from a torch.Generator"
        if why is None:
            from hybridflow.kernels.backend import BackendUnavailable, warn_once, cpu_extension

            try:
                return cpu_extension()
            except BackendUnavailable as exc:
                if self.decode == "cpu":
                    raise
                warn_once(f"the C++ decode loop is unavailable, decoding in Python: {exc}")
                return None
        if self.decode == "cpu":
            raise ValueError(f"decode='cpu' cannot run this call: {why}")
        return None

    def _weights(self) -> list[torch.Tensor]:
        """The parameters in the order the C++ prefill and decode loop take them (read at each call)."""
        model = self.model
        weights = []
        for layer in model.layers:
            bias = layer.attn.qkv.bias
            weights += [layer.attn_norm.weight, layer.attn.qkv.weight,
                        torch.empty(0) if bias is None else bias, layer.attn.proj.weight,
                        layer.mlp_norm.weight, layer.mlp.fc1.weight, layer.mlp.fc2.weight]
        weights += [model.embed.weight, model.norm.weight, model.output_weight]
        return [w.detach().contiguous() for w in weights]

    def _fused_prefill(self, ext, input_ids, attention_mask, cache: KVCache, n: int) -> torch.Tensor:
        """The prompts into the empty cache in one C++ call, as `forward_cached` on a first append (padding is
        not computed); the logits [b, V] after each prompt's last token."""
        model = self.model
        logits = ext.prefill(input_ids.long().contiguous(), attention_mask, n, self._weights(), cache.k, cache.v,
                             cache.key_mask, cache.seen, model.inv_freq.float().contiguous(),
                             model.cfg.heads_per_group, float(model.cfg.rms_norm_eps))
        cache.start, cache.length = 0, input_ids.shape[1]
        return logits

    def _fused_decode(self, ext, logits, cache: KVCache, params: SamplingParams, keys, stop_ids):
        model = self.model
        filled, steps = cache.length, params.max_new_tokens
        tokens, log_probs, mask, length = ext.decode_loop(
            logits.float().contiguous(), self._weights(), cache.k, cache.v,
            cache.key_mask, cache.seen, filled, model.inv_freq.float().contiguous(), model.cfg.heads_per_group,
            float(model.cfg.rms_norm_eps), steps, params.greedy, float(params.temperature),
            torch.empty(0, dtype=torch.long) if keys is None else keys.contiguous(), stop_ids, self.pad_token_id)
        length = int(length)
        if length > 1:  # the slots the fed tokens took, as forward_cached leaves them (the last token is not fed)
            cache.start, cache.length = filled + length - 2, filled + length - 1
        return tokens, log_probs, mask, length


def decode_loop(logits: torch.Tensor, params: SamplingParams, generator, keys: Optional[torch.Tensor],
                stop_ids: torch.Tensor, pad_token_id: int, tokenizer: Any,
                next_logits: Callable[[torch.Tensor], torch.Tensor],
                drop_rows: Optional[Callable[[torch.Tensor], None]] = None):
    """The eager decode steps after a prefill, shared by the built-in engine and `hf_generate.HFGenerator`:
    sample each live row's token (keyed streams advance one a step), record it, end rows on a stop id or
    stop string, until every row has ended or `max_new_tokens` are done. `next_logits(token [live])` feeds
    the live rows' tokens to the model and returns their next logits [live, V]; `drop_rows(keep)` removes
    the ended rows from the caller's cache once they are `_COMPACT_AT` of the batch (None: never, ended rows
    are fed padding). Returns tokens, log_probs, mask [rows, max_new_tokens] and the steps run."""
    rows, steps, device = logits.shape[0], params.max_new_tokens, logits.device
    tokens = torch.full((rows, steps), pad_token_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(rows, steps, device=device)
    mask = torch.zeros(rows, steps, dtype=torch.long, device=device)
    live = torch.arange(rows, device=device)  # output row of each cache row
    done = torch.zeros(rows, dtype=torch.bool, device=device)  # per cache row
    length = 0
    while True:
        token, log_prob = sample(logits, params, generator, None if keys is None else keys + length)
        token = token.masked_fill(done, pad_token_id)
        tokens[live, length] = token
        log_probs[live, length] = log_prob.masked_fill(done, 0.0)
        mask[live, length] = (~done).long()
        done |= torch.isin(token, stop_ids)
        length += 1
        if params.stop:
            done |= completes_stop_string(tokenizer, tokens[live, :length], done, params.stop)
        ended = int(done.sum())
        if length == steps or ended == done.numel():
            return tokens, log_probs, mask, length
        if drop_rows is not None and ended >= _COMPACT_AT * done.numel():
            keep = (~done).nonzero().flatten()
            drop_rows(keep)
            live, done, token = live[keep], done[keep], token[keep]
            keys = None if keys is None else keys[keep]
        logits = next_logits(token)


def completes_stop_string(tokenizer: Any, tokens: torch.Tensor, done: torch.Tensor,
                          stop: tuple[str, ...]) -> torch.Tensor:
    """Rows [N] (bool) not yet done whose last token completes one of `stop` (tokens: [N, steps so far]).

    Only the tail of each row is decoded: an earlier occurrence would
    already have ended the row.
    """
    lookback = _TOKENS_PER_CHAR * max(len(s) for s in stop)
    tails = tokens[:, -lookback:].tolist()
    hits = torch.zeros_like(done)
    for row in (~done).nonzero().flatten().tolist():
        text = tokenizer.decode(tails[row])
        hits[row] = any(s in text for s in stop)
    return hits


def row_streams(row_keys: Optional[torch.Tensor], n: int, steps: int, device) -> Optional[torch.Tensor]:
    """One sampling stream per (prompt, sample) from the prompts' keys, spaced `steps + 1` apart so the
    decode loop can advance each by one a step; None without keys."""
    if row_keys is None:
        return None
    per_sample = row_keys.long().to(device).repeat_interleave(n) * n + torch.arange(n, device=device).repeat(
        row_keys.shape[0])
    return per_sample * (steps + 1)


def generation_output(input_ids, attention_mask, n: int, home, tokens, log_probs, mask, length: int) -> GenerationOutput:
    """The GenerationOutput of a decode that ran `length` steps, on the prompts' device (`home`)."""
    return GenerationOutput(
        prompts=input_ids.repeat_interleave(n, 0).to(home),
        prompt_mask=attention_mask.long().repeat_interleave(n, 0).to(home),
        responses=tokens[:, :length].to(home).contiguous(),
        response_mask=mask[:, :length].to(home).contiguous(),
        log_probs=log_probs[:, :length].to(home).contiguous(),
    )
