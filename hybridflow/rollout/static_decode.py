"""The GPU decode path of the built-in generator: a decode step whose every tensor has a fixed shape, so
that it can be captured once as a CUDA graph and replayed per token.

    dec = StaticDecoder(model, capture="graph")    # "graph" (torch.cuda.CUDAGraph), "compile", "eager"
    tokens, log_probs, mask, length = dec.generate(input_ids, attention_mask, params, keys, stop_ids, pad)

What is fixed per captured step (one `DecodeState` per batch bucket):
- the batch: a bucket from `BUCKETS` (powers of two and 1.5x powers of two), the real rows first,
  padding rows after them (ended from the start, fed padding, never written out);
- the cache: `[bucket, kv_heads, capacity, head_dim]` per layer, zero-filled once, capacity the longest
  prompt + max_new_tokens rounded up to `CAPACITY_MULTIPLE` (so prompts of similar length share a graph);
- the write slot `pos` and the step counter `step` are one-element device tensors, advanced inside the
  step, so a replay needs no host value. Attention is over the whole capacity with a boolean mask
  (`key_mask`, plus the sliding window as `slot > pos - window`), the same keys the eager path's slice
  holds, so the softmax differs from it only in float rounding;
- sampling (greedy, temperature, top-k / top-p, keyed per row by `counter_uniform(keys + step)`) runs
  inside the step, as `sampling.sample` computes it (free of host syncs); in a CUDA graph the keyed
  draw is a compiled kernel (`keyed_choice`). Ended rows are masked (fed padding, log-prob 0, mask 0),
  never removed inside the graph.

The host syncs once every `CHECK_EVERY` steps: it reads how many rows are live, stops when none is, and
once a quarter of the real rows have ended moves the live ones (their cache up to `pos`, their key mask,
positions, keys, last token) into the state of the smallest bucket that holds them, whose step was
captured the first time it was needed. A row's outputs are written into its bucket's `[bucket, steps]`
buffers and copied out (to the call's output rows) when the rows move and at the end.

Weights are never copied: the step reads the model's parameters, so a graph replays on whatever the
hybrid engine wrote into them in place. A state remembers the parameters' storage addresses; if any
moved (the model was rebuilt or moved), every captured step is dropped and captured again.
States persist across calls with the same (bucket, capacity, steps, sampling) key, and across
`Generator.release` (the trainer releases the rollout engine every step; recapturing each time would
cost more than the memory held); a different key drops the others, `StaticDecoder.release` all.

The prefill is `Decoder.forward_cached` into a `KVCache` of the prompts' length: one pass over each
prompt's tokens with `scaled_dot_product_attention` (a boolean mask for the left padding, so on CUDA the
memory-efficient kernel rather than flash), each prompt written into its n rows, then copied into the
bucket's cache.

On the CPU the same step runs eagerly (`capture` is ignored): that is what the CPU tests compare with the
eager loop. Tensor parallelism: the model's collectives run inside the step (gloo eagerly on the CPU; on
CUDA an NCCL all-reduce is captured into the graph, which the first GPU run has to confirm).
Simplified: no stop strings (they need the host at every step: the generator decodes those calls
eagerly); sampling from a `torch.Generator` is not done here — the generator draws one key per prompt
and the rows are sampled keyed.
"""
from __future__ import annotations

import bisect
from typing import Optional

import torch
import torch.nn.functional as F

from hybridflow.models.decoder import Decoder, MoE, rope_cos_sin
from hybridflow.models.kv_cache import KVCache
from hybridflow.rollout.sampling import SamplingParams, keyed_choice, sample

BUCKETS = tuple(sorted({2 ** k for k in range(15)} | {3 * 2 ** k for k in range(14)}))  # 1, 2, 3, 4, 6, 8, ..
CAPACITY_MULTIPLE = 128  # slots; also keeps the mask's last dim aligned for the fused SDPA kernels
CHECK_EVERY = 8          # decode steps between host reads of "how many rows are live"
COMPACT_AT = 0.25        # move the live rows to a smaller bucket once this fraction of the real rows ended
WARMUP = 2               # eager runs of a step before it is captured (cuBLAS / allocator warm-up)
CAPTURES = ("graph", "compile", "eager")


def bucket_size(rows: int) -> int:
    """The smallest bucket holding `rows` rows (rows beyond the largest bucket: `rows` itself)."""
    i = bisect.bisect_left(BUCKETS, rows)
    return BUCKETS[i] if i < len(BUCKETS) else rows


def cache_capacity(prompt_len: int, steps: int, multiple: int = CAPACITY_MULTIPLE) -> int:
    """Slots for the prompt and every generated token but the last (which is never fed), rounded up."""
    need = prompt_len + steps
    return -(-need // multiple) * multiple


class DecodeState:
    """The static buffers one bucket's captured step reads and writes (all allocated once)."""

    def __init__(self, model: Decoder, bucket: int, capacity: int, steps: int, device: torch.device):
        cfg = model.cfg
        dtype = model.embed.weight.dtype
        shape = (bucket, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.bucket, self.capacity, self.steps = bucket, capacity, steps
        # One tensor per layer (as gpt-fast and HF's StaticCache keep them): torch.compile then writes each
        # in place, where slices of one [layers, ...] buffer could be functionalised into copies of it.
        # Zeros, not empty: a masked slot still enters attn @ V with weight 0, and 0 * NaN is NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.key_mask = torch.zeros(bucket, capacity, dtype=torch.bool, device=device)
        self.slots = torch.arange(capacity, device=device)
        self.seen = torch.zeros(bucket, dtype=torch.long, device=device)   # position id of the fed token
        self.pos = torch.zeros(1, dtype=torch.long, device=device)         # cache slot of the fed token
        self.step = torch.zeros(1, dtype=torch.long, device=device)        # output column of the sample
        self.token = torch.zeros(bucket, dtype=torch.long, device=device)  # the token fed next
        self.done = torch.ones(bucket, dtype=torch.bool, device=device)
        self.keys = torch.zeros(bucket, dtype=torch.long, device=device)
        self.out_tokens = torch.zeros(bucket, steps, dtype=torch.long, device=device)
        self.out_log_probs = torch.zeros(bucket, steps, dtype=torch.float32, device=device)
        self.out_mask = torch.zeros(bucket, steps, dtype=torch.bool, device=device)
        # The call's stop ids, copied: a captured step reads what lives at a tensor's address when it was
        # captured, and the caller's tensor is freed when its call returns (a second call's replay then read
        # whatever the allocator had put there: rows ran past their EOS on the first GPU run).
        self.stop_ids = torch.zeros(0, dtype=torch.long, device=device)
        self.replay = None  # the captured step, set by StaticDecoder

    def tensors(self) -> list[torch.Tensor]:
        return self.k + self.v + [self.key_mask, self.slots, self.seen, self.pos, self.step, self.token,
                                  self.done, self.keys, self.out_tokens, self.out_log_probs, self.out_mask,
                                  self.stop_ids]

    def clear(self, pad: int) -> None:
        """Every row padding (ended), nothing attended to: what `load` and the prefill start from."""
        self.key_mask.zero_()
        self.seen.zero_()
        self.token.fill_(pad)
        self.done.fill_(True)
        self.keys.zero_()

    def load(self, src: "DecodeState", rows: torch.Tensor, filled: int, pad: int) -> None:
        """Rows `rows` of `src` into rows 0..len(rows)-1 here, the cache up to slot `filled`."""
        m = rows.numel()
        self.clear(pad)
        for dst, s in ((self.k, src.k), (self.v, src.v)):
            for layer in range(len(dst)):
                dst[layer][:m, :, :filled] = s[layer][rows, :, :filled]
        self.key_mask[:m] = src.key_mask[rows]
        for name in ("seen", "token", "done", "keys"):
            getattr(self, name)[:m] = getattr(src, name)[rows]
        self.pos.copy_(src.pos)
        self.step.copy_(src.step)


def _attention_mask(st: DecodeState, window: Optional[int]) -> torch.Tensor:
    """[bucket, 1, 1, capacity]: the slots the fed token attends to (its own slot is in key_mask)."""
    allowed = st.key_mask
    if window is not None:
        allowed = allowed & (st.slots > st.pos - window)[None]
    return allowed[:, None, None]


def forward_step(model: Decoder, st: DecodeState) -> torch.Tensor:
    """Feed `st.token` at slot `st.pos` (position `st.seen`) through every layer; logits [bucket, V].

    The same ops as `Decoder.forward_cached` on one token, with the keys and values written by
    `index_copy_` at a device-held slot and attention over the whole capacity under a mask.
    """
    cfg = model.cfg
    b = st.bucket
    hpg, hd = cfg.heads_per_group, cfg.head_dim
    st.key_mask |= (st.slots == st.pos)[None]  # the fed token's slot (elementwise: nothing for the host to read)
    x = model.embed_tokens(st.token[:, None])
    cos, sin = rope_cos_sin(model.inv_freq, st.seen[:, None], x.dtype)
    masks = {w: _attention_mask(st, w) for w in set(cfg.layer_windows)}
    for layer, window in zip(model.layers, cfg.layer_windows):
        attn = layer.attn
        qkv = attn.qkv(layer.attn_norm(x)).view(b, 1, -1, hpg + 2, hd)
        qk = attn.rotate_qk(qkv, cos, sin)
        st.k[attn.layer].index_copy_(2, st.pos, qk[:, :, :, hpg].transpose(1, 2))
        st.v[attn.layer].index_copy_(2, st.pos, qkv[:, :, :, hpg + 1].transpose(1, 2))
        # A group's heads are the query rows of its one kv head: [b, groups, hpg, hd] against [b, groups, C, hd].
        out = F.scaled_dot_product_attention(qk[:, 0, :, :hpg], st.k[attn.layer], st.v[attn.layer],
                                             attn_mask=masks[window])
        x = x + attn.parallel.all_reduce(attn.proj(out.reshape(b, 1, -1)))
        h = layer.mlp_norm(x)
        x = x + (layer.mlp.forward_dense(h) if isinstance(layer.mlp, MoE) else layer.mlp(h))
    st.seen.add_(1)
    st.pos.add_(1)
    return model.logits(model.norm(x))[:, -1]


_COMPILED_CHOICE = None


def compiled_keyed_choice():
    """`keyed_choice` under torch.compile (one per process, so each generator reuses its kernels)."""
    global _COMPILED_CHOICE
    if _COMPILED_CHOICE is None:
        _COMPILED_CHOICE = torch.compile(keyed_choice, fullgraph=True)
    return _COMPILED_CHOICE


def sample_step(st: DecodeState, logits: torch.Tensor, params: SamplingParams, keyed: bool,
                stop_ids: torch.Tensor, pad: int, choose=keyed_choice) -> None:
    """Choose each row's next token from `logits` [bucket, V] and write it to column `st.step`."""
    token, log_prob = sample(logits, params, None, st.keys + st.step if keyed else None, choose)
    token = token.masked_fill(st.done, pad)
    st.out_tokens.index_copy_(1, st.step, token[:, None])
    st.out_log_probs.index_copy_(1, st.step, log_prob.masked_fill(st.done, 0.0)[:, None])
    st.out_mask.index_copy_(1, st.step, (~st.done)[:, None])
    st.done |= (token[:, None] == stop_ids[None]).any(-1)  # isin without a possible host sync
    st.token.copy_(token)
    st.step.add_(1)


class StaticDecoder:
    """Static-shape decode states and their captured steps for one model (see the module doc)."""

    def __init__(self, model: Decoder, capture: str = "graph", fuse_noise: bool = True):
        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}")
        self.model, self.capture = model, capture
        # capture="graph" on CUDA: the keyed draw compiled (torch.compile, no CUDA graphs of its own) and
        # captured inside the step's graph. capture="compile" fuses it with the rest of the step anyway.
        self.fuse_noise = fuse_noise
        self.states: dict[tuple, DecodeState] = {}
        self.family: Optional[tuple] = None
        self.addresses: Optional[list[int]] = None
        self.pool = None
        self.captures = 0  # steps captured (or compiled) so far, for tests and benchmarks

    def release(self) -> None:
        """Drop every state and captured step (their memory returns to the allocator)."""
        self.states.clear()
        self.family = self.addresses = self.pool = None

    def _mode(self, device: torch.device) -> str:
        return self.capture if device.type == "cuda" else "eager"

    def _check_weights(self) -> None:
        """Drop the captured steps if a parameter no longer lives where they read it. In a tensor-parallel
        group the ranks agree first (any rank's move drops every rank's steps): the allocator may place a
        refilled shard elsewhere on one rank only, and a rank capturing alone would run the capture's
        warm-up collectives without its peers."""
        addresses = [p.data_ptr() for p in self.model.parameters()]
        moved = addresses != self.addresses
        parallel = getattr(self.model, "parallel", None)
        if getattr(parallel, "size", 1) > 1:
            flag = torch.tensor([1.0 if moved else 0.0], device=self.model.embed.weight.device)
            moved = parallel.all_reduce(flag).item() > 0
        if moved:
            self.release()
            self.addresses = addresses

    def state(self, bucket: int, capacity: int, params: SamplingParams, keyed: bool,
              stop_ids: torch.Tensor, pad: int) -> DecodeState:
        """The bucket's state for this call's shapes and sampling, its step captured on first use."""
        family = (capacity, params.max_new_tokens, params.greedy, params.temperature, params.top_k,
                  params.top_p, keyed, tuple(stop_ids.tolist()), pad)
        if family != self.family:  # other shapes or sampling: the old graphs will not be replayed
            self.states.clear()
            # Their graphs are gone, and with them the pool's last user: the allocator frees a pool whose
            # use count fell to 0 and refuses to capture into it again (an INTERNAL ASSERT, `use_count > 0`,
            # on the first GPU run of the demo, where validation's greedy family alternates with training's).
            self.pool = None
            self.family = family
        if bucket not in self.states:
            device = stop_ids.device
            st = DecodeState(self.model, bucket, capacity, params.max_new_tokens, device)
            st.stop_ids = stop_ids.clone()  # the family fixes their values; the state owns their storage
            st.replay = self._capture(st, params, keyed, pad, self._mode(device))
            self.states[bucket] = st
        return self.states[bucket]

    def _capture(self, st: DecodeState, params, keyed, pad, mode: str):
        """A zero-argument callable running one decode step on `st` (captured or compiled on CUDA).

        Warm-up and capture run on the fresh state (every row ended, outputs at columns < WARMUP); the
        caller loads the real rows afterwards, so nothing they wrote survives.
        """
        model = self.model
        choose = keyed_choice
        if mode == "graph" and keyed and self.fuse_noise:
            choose = compiled_keyed_choice()

        def step():
            sample_step(st, forward_step(model, st), params, keyed, st.stop_ids, pad, choose)

        self.captures += 1
        warm = min(WARMUP, st.steps)

        def warm_up(fn):
            for _ in range(warm):
                st.pos.zero_(), st.step.zero_()
                fn()
            st.pos.zero_(), st.step.zero_()

        if mode == "eager":  # warmed up too, so the CPU tests see a state the warm-up wrote into
            warm_up(step)
            return step

        if mode == "compile":
            for t in st.tensors():
                torch._dynamo.mark_static_address(t)
            # Every state is one more compile of the same `step` code (its closure differs), and dynamo keeps
            # each entry for the process's life: with fullgraph=True, reaching its recompile limit raises
            # (FailOnRecompileLimitHit). The limit is kept above the compiles made so far.
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), 64, self.captures + 8))
            compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)
            warm_up(compiled)  # reduce-overhead warms up, then records its CUDA graph on later calls
            return compiled
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm_up(step)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # one pool for every bucket: they replay one at a time
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        st.pos.zero_(), st.step.zero_()
        st.graph = graph
        return graph.replay

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 keys: Optional[torch.Tensor], stop_ids: torch.Tensor, pad: int):
        """Prefill and decode left-padded prompts [b, T] (on the model's device): tokens, log_probs, mask
        [b*n, max_new_tokens] and the number of steps any row ran, as `Generator._python_decode` returns."""
        model, n, steps = self.model, params.n, params.max_new_tokens
        b, t = input_ids.shape
        rows, device = b * n, input_ids.device
        keyed = keys is not None and not params.greedy
        self._check_weights()
        capacity = cache_capacity(t, steps)
        st = self.state(bucket_size(rows), capacity, params, keyed, stop_ids, pad)
        st.clear(pad)
        # The prefill fills a KVCache of the prompts' length, then its slots move into the state's first rows.
        cache = KVCache(model.cfg, rows, t, st.k[0].dtype, device)
        logits = model.forward_cached(input_ids, cache, attention_mask, last_only=True)[:, -1]
        for layer in range(len(st.k)):
            st.k[layer][:rows, :, :t] = cache.k[layer]
            st.v[layer][:rows, :, :t] = cache.v[layer]
        st.key_mask[:rows, :t] = cache.key_mask
        st.seen[:rows] = cache.seen
        del cache
        st.done[:rows] = False
        if keyed:
            st.keys[:rows] = keys
        st.pos.fill_(t)
        st.step.zero_()
        first = torch.zeros(st.bucket, logits.shape[-1], dtype=logits.dtype, device=device)
        first[:rows] = logits.repeat_interleave(n, 0)
        sample_step(st, first, params, keyed, st.stop_ids, pad)  # the first token, eagerly

        tokens = torch.full((rows, steps), pad, dtype=torch.long, device=device)
        log_probs = torch.zeros(rows, steps, device=device)
        mask = torch.zeros(rows, steps, dtype=torch.bool, device=device)
        live = torch.arange(rows, device=device)  # output row of each real row of the state
        begin, done_at = 0, 1                      # output columns this state wrote: [begin, done_at)

        def flush():
            m = live.numel()
            tokens[live, begin:done_at] = st.out_tokens[:m, begin:done_at]
            log_probs[live, begin:done_at] = st.out_log_probs[:m, begin:done_at]
            mask[live, begin:done_at] = st.out_mask[:m, begin:done_at]

        while True:
            left = int((~st.done[:live.numel()]).sum())  # the host sync, once per CHECK_EVERY steps
            if left == 0 or done_at == steps:
                break
            smaller = bucket_size(left)
            if left <= (1 - COMPACT_AT) * live.numel() and smaller < st.bucket:
                keep = (~st.done[:live.numel()]).nonzero().flatten()
                flush()
                new = self.state(smaller, capacity, params, keyed, stop_ids, pad)
                new.load(st, keep, t + done_at - 1, pad)
                st, live, begin = new, live[keep], done_at
            for _ in range(min(CHECK_EVERY, steps - done_at)):
                st.replay()
                done_at += 1
        flush()
        length = int(mask.sum(1).max())
        return tokens, log_probs, mask.long(), length
