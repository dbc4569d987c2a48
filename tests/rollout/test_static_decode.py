"""The static-shape decode path (hybridflow/rollout/static_decode.py) against the eager loop.

On the CPU the step runs eagerly, the same function a CUDA graph captures: the same tokens as the
eager loop (greedy and keyed sampling, float32, every family of conftest.FAMILIES, rows ending at
different steps so masking and the move to smaller buckets happen), log-probs within 1e-5; bfloat16
log-probs within a stated tolerance; weights read in place (the invariant a captured graph relies on);
tensor parallelism at tg = 2 over gloo; the step traced whole by torch.compile. The `gpu` tests replay
real CUDA graphs (and reduce-overhead) against the eager loop on the GPU.

Checked to fail when broken: the step holding a deep copy of the model, the weight-address check
turned off, the cache rows not copied when rows move buckets, ended rows not fed padding, the
sliding-window term left out of the mask.
"""
import pytest
import torch

from hybridflow.rollout import Generator, SamplingParams
from hybridflow.rollout.sampling import keyed_choice
from hybridflow.rollout import static_decode
from hybridflow.rollout.static_decode import BUCKETS, StaticDecoder, bucket_size, cache_capacity
from tests.rollout.conftest import PAD, left_padded_prompts, tiny_decoder

KEYS = torch.tensor([5, 6, 7, 8])
EOS = tuple(range(1, 101, 10))  # ten EOS ids of 101: rows end at varied steps well before 40
# bfloat16: |static - eager| log-prob over the tokens both chose alike (see test_bfloat16_log_probs...): at
# most BF16_ATOL (a bfloat16 step at |log-prob| ~8 is 0.03-0.06), on average BF16_MEAN. Measured on the CPU
# over the three families: max 0.022-0.047, mean 0.005-0.006.
BF16_ATOL, BF16_MEAN = 0.1, 0.02


def _params(greedy: bool, **kw) -> SamplingParams:
    base = dict(max_new_tokens=40, n=3, temperature=0.9, do_sample=not greedy, stop_token_ids=EOS)
    return SamplingParams(**{**base, **kw})


def _assert_same(got, want, atol=1e-5):
    assert torch.equal(got.responses, want.responses)
    assert torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.log_probs, want.log_probs, atol=atol, rtol=0)


def test_buckets_and_capacity():
    assert BUCKETS[:10] == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    assert [bucket_size(r) for r in (1, 5, 12, 13, 200, 256, 257)] == [1, 6, 12, 16, 256, 256, 384]
    assert bucket_size(10 ** 6) == 10 ** 6  # beyond the largest bucket: the batch itself
    assert cache_capacity(9, 40) == 128 and cache_capacity(100, 28) == 128 and cache_capacity(100, 29) == 256


@pytest.mark.parametrize("kw", [dict(do_sample=False), dict(temperature=0.8),
                                dict(temperature=1.3, top_k=50, top_p=0.9)])
def test_the_steps_sampler_is_samplings(kw):
    """sample_step (what the step runs) writes sampling.sample's tokens and log-probs bit for bit, drawn
    with the row's key advanced by the step."""
    from hybridflow.rollout.sampling import sample

    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    keys = torch.arange(64) * 977 + 5
    params = SamplingParams(max_new_tokens=4, **kw)
    st = static_decode.DecodeState(tiny_decoder("llama-gqa"), 64, 128, 4, torch.device("cpu"))
    st.keys.copy_(keys)
    st.done.fill_(False)
    st.step.fill_(2)
    static_decode.sample_step(st, logits, params, True, torch.tensor([-1]), PAD)
    want = sample(logits, params, None, keys + 2)
    assert torch.equal(st.out_tokens[:, 2], want[0]) and torch.equal(st.out_log_probs[:, 2], want[1])
    assert want[0].unique().numel() > 30


@pytest.mark.parametrize("sampling", ["greedy", "keyed", "keyed-top-k-top-p"])
def test_static_path_gives_the_eager_loops_tokens(family, sampling):
    """Rows end unevenly: ended rows are masked inside the step, and the live ones move to smaller buckets."""
    model = tiny_decoder(family)
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    params = _params(sampling == "greedy", **(dict(top_k=20, top_p=0.9) if "top" in sampling else {}))
    want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS)
    gen = Generator(model, PAD, decode="static")
    got = gen.generate(ids, mask, params, row_keys=KEYS)
    lengths = want.response_mask.sum(1)
    assert lengths.min() < lengths.max() and lengths.min() < 40 - static_decode.CHECK_EVERY
    _assert_same(got, want)
    assert len(gen.static.states) > 1, "no row moved to a smaller bucket"
    captures = gen.static.captures
    _assert_same(gen.generate(ids, mask, params, row_keys=KEYS), want)  # the states are reused
    assert gen.static.captures == captures


def test_moving_rows_to_smaller_buckets_changes_no_output(monkeypatch):
    """The same outputs whether the live rows stay in the first bucket or move at every check."""
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    params = _params(False, n=4)
    monkeypatch.setattr(static_decode, "COMPACT_AT", 2.0)  # never move
    stay = Generator(model, PAD, decode="static")
    kept = stay.generate(ids, mask, params, row_keys=KEYS)
    assert sorted(stay.static.states) == [16]
    monkeypatch.setattr(static_decode, "COMPACT_AT", 0.0)  # move whenever a smaller bucket holds them
    monkeypatch.setattr(static_decode, "CHECK_EVERY", 1)
    move = Generator(model, PAD, decode="static")
    moved = move.generate(ids, mask, params, row_keys=KEYS)
    assert len(move.static.states) >= 4, sorted(move.static.states)
    _assert_same(moved, kept)
    assert kept.response_mask.sum(1).min() < 10  # rows did end early


def test_no_row_ends_and_every_row_ends_at_once():
    model = tiny_decoder("qwen2-bias-tied")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    for params in (SamplingParams(max_new_tokens=13, do_sample=False, n=5),  # 20 rows: 4 padding rows of 24
                   SamplingParams(max_new_tokens=1, do_sample=False),
                   SamplingParams(max_new_tokens=9, temperature=0.8, stop_token_ids=tuple(range(101)))):
        want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS)
        gen = Generator(model, PAD, decode="static")
        _assert_same(gen.generate(ids, mask, params, row_keys=KEYS), want)
        assert sorted(gen.static.states) == [bucket_size(4 * params.n)]
    assert want.responses.shape[1] == 1  # every row ended on its first token


def test_weights_are_read_in_place():
    """The invariant a captured graph relies on: after the hybrid engine copies new weights into the same
    parameters, the same (already captured) step decodes the new model's tokens. A step holding a copy
    of the weights fails here (checked by making `_capture` deep-copy the model). A parameter that moved
    to new storage is seen too: the captured steps are dropped and captured again."""
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    params = _params(True)
    gen = Generator(model, PAD, decode="static")
    before = gen.generate(ids, mask, params).responses
    captures = gen.static.captures
    other = tiny_decoder("llama-gqa", seed=5)
    gen.release()  # what the trainer calls before each update: the captured steps stay
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)
    after = gen.generate(ids, mask, params)
    want = Generator(other, PAD, decode="python").generate(ids, mask, params)
    assert gen.static.captures == captures  # the same steps replayed
    _assert_same(after, want)
    assert not torch.equal(before, after.responses)

    third = tiny_decoder("llama-gqa", seed=9)
    model.load_state_dict(third.state_dict(), assign=True)  # new storage: the old steps must not replay
    _assert_same(gen.generate(ids, mask, params), Generator(third, PAD, decode="python").generate(ids, mask, params))
    assert gen.static.captures > captures


def test_a_state_reads_no_tensor_of_an_earlier_call():
    """A captured step reads the storage its tensors had when it was captured, so everything it reads must
    be the state's or the model's: a tensor of the call that captured it is freed when that call returns,
    and a later replay reads what the allocator put there (on the first GPU run, the stop ids: replays ran
    past EOS). On the CPU the step runs eagerly on the same closure, so overwriting the first call's stop
    ids shows whether the step still reads them."""
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    params = _params(True)
    dec = StaticDecoder(model)
    stop = torch.tensor(EOS)
    first = dec.generate(ids, mask, params, None, stop, PAD)
    assert first[2].sum(1).min() < 40  # rows did stop early
    captures = dec.captures
    stop.fill_(-1)  # what a freed and reused block would hold
    again = dec.generate(ids, mask, params, None, torch.tensor(EOS), PAD)
    assert dec.captures == captures  # the first call's steps replayed
    for got, want in zip(again, first):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))


def test_a_new_sampling_family_captures_into_a_new_pool():
    """Changing the sampling (validation's greedy family, then training's) drops the captured steps, and
    with them their graph pool's last user: the next capture must not reuse that pool (the CUDA allocator
    asserts `use_count > 0` there, seen on the first GPU run of the demo)."""
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    dec = StaticDecoder(model)
    dec.generate(ids, mask, _params(True), None, torch.tensor(EOS), PAD)
    dec.pool = object()  # stands for the pool handle a CUDA capture leaves (none is made on the CPU)
    dec.generate(ids, mask, _params(True), None, torch.tensor(EOS), PAD)
    assert dec.pool is not None  # the same family: its states and pool are kept
    dec.generate(ids, mask, _params(False), KEYS.repeat_interleave(3), torch.tensor(EOS), PAD)
    assert dec.pool is None


def test_sampling_from_a_torch_generator_draws_keys_from_it():
    """Without row_keys the static path draws one key per prompt from the generator: reproducible for a
    seed, different for another, log-probs of log_softmax(logits / T) as a full forward recomputes them."""
    model = tiny_decoder("mistral-window")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, n=2)
    gen = Generator(model, PAD, decode="static")
    first = gen.generate(ids, mask, params, torch.Generator().manual_seed(1))
    again = gen.generate(ids, mask, params, torch.Generator().manual_seed(1))
    other = gen.generate(ids, mask, params, torch.Generator().manual_seed(2))
    assert torch.equal(first.responses, again.responses) and not torch.equal(first.responses, other.responses)
    seq = torch.cat([first.prompts, first.responses], 1)
    with torch.no_grad():
        logits = model(seq, torch.cat([first.prompt_mask, first.response_mask], 1))[:, ids.shape[1] - 1:-1]
    ref = (logits / 0.7).log_softmax(-1).gather(-1, first.responses[..., None])[..., 0]
    torch.testing.assert_close(first.log_probs, ref, atol=1e-4, rtol=1e-4)


def test_which_path_runs():
    """"auto" never takes the static path on the CPU; "static" refuses stop strings by name."""
    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    gen = Generator(model, PAD)
    gen.generate(ids, mask, _params(True))
    assert gen.static.captures == 0
    with pytest.raises(ValueError, match="decode='static' cannot run stop strings"):
        Generator(model, PAD, tokenizer=object(), decode="static").generate(ids, mask, _params(True, stop=("x",)))
    with pytest.raises(ValueError, match="capture must be one of"):
        StaticDecoder(model, capture="cudagraph")


def test_auto_falls_back_to_the_eager_loop_when_the_static_path_fails(monkeypatch):
    """"auto" where the static path applies (CUDA; here made to apply) and fails: a warning, the eager
    loop's tokens, and the eager loop from then on; "static" raises the failure."""
    from hybridflow.kernels import backend

    model = tiny_decoder("llama-gqa")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    want = Generator(model, PAD, decode="python").generate(ids, mask, _params(False), row_keys=KEYS)
    gen = Generator(model, PAD, decode="python")
    gen.decode = "auto"
    monkeypatch.setattr(Generator, "_static_applies", lambda self, params, device: (
        self.decode == "static" or self.static_failed is None))

    def broken(*args, **kwargs):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(gen.static, "generate", broken)
    warned = []
    monkeypatch.setattr(backend, "warn_once", warned.append)
    _assert_same(gen.generate(ids, mask, _params(False), row_keys=KEYS), want)
    assert gen.static_failed == "RuntimeError: capture failed" and "capture failed" in warned[0]
    _assert_same(gen.generate(ids, mask, _params(False), row_keys=KEYS), want)  # no second try
    gen.decode, gen.static_failed = "static", None
    with pytest.raises(RuntimeError, match="capture failed"):
        gen.generate(ids, mask, _params(False), row_keys=KEYS)


def test_bfloat16_log_probs_within_tolerance(family):
    """bfloat16 model: the static step attends over the whole capacity under a mask, the eager loop over
    a slice, so sums round differently. Over each row's tokens up to the first that differs (a near-tie
    may flip), log-probs agree within BF16_ATOL (mean BF16_MEAN), and most tokens agree."""
    model = tiny_decoder(family).to(torch.bfloat16)
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    params = _params(False, n=4)
    want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS)
    got = Generator(model, PAD, decode="static").generate(ids, mask, params, row_keys=KEYS)
    _assert_bf16_close(got, want)


def _assert_bf16_close(got, want):
    r = min(got.responses.shape[1], want.responses.shape[1])
    same = (got.responses[:, :r] == want.responses[:, :r]).long().cumprod(1).bool()
    same &= want.response_mask[:, :r].bool()
    assert same.sum() >= 0.8 * want.response_mask.sum(), "the bfloat16 paths diverge early"
    diff = (got.log_probs[:, :r] - want.log_probs[:, :r]).abs()[same].float()
    assert diff.max() <= BF16_ATOL, f"max |diff| {diff.max():.3g} > {BF16_ATOL}"
    assert diff.mean() <= BF16_MEAN, f"mean |diff| {diff.mean():.3g} > {BF16_MEAN}"


def tp_workloads() -> dict:
    """The tg = 2 check's calls (static_tp_check.py): greedy, and keyed with EOS ids that end rows unevenly."""
    keys = torch.tensor([11, 12, 13])
    return {"greedy": (SamplingParams(max_new_tokens=16, do_sample=False, n=2, stop_token_ids=(21, 8)), None),
            "keyed": (SamplingParams(max_new_tokens=16, temperature=1.0, n=4, stop_token_ids=(3, 9, 20, 30)), keys)}


def test_tg2_static_path_equals_one_rank(two_process_launch):
    """Two gloo processes, each with its shard (static_tp_check.py, in the suite's 2-process launch): the
    static step's all-reduces and vocabulary gathers give the one-rank eager loop's tokens and log-probs,
    moving rows to smaller buckets on the way."""
    from hybridflow.models import Decoder
    from tests.hybrid_engine.test_tensor_parallel_generation import case

    got = torch.load(two_process_launch["static_tp"])
    cfg, bridge, full, batch = case(False, tp=1)
    model = Decoder(cfg)
    model.load_state_dict(bridge.megatron_to_generation(full), strict=False)
    for name, (params, keys) in tp_workloads().items():
        want = Generator(model.eval(), PAD, decode="python").generate(batch["ids"], batch["mask"], params,
                                                                      row_keys=keys)
        lengths = want.response_mask.sum(1)
        assert lengths.min() < lengths.max(), name
        assert torch.equal(got[name]["responses"], want.responses), name
        assert torch.equal(got[name]["response_mask"], want.response_mask), name
        torch.testing.assert_close(got[name]["log_probs"], want.log_probs, atol=1e-5, rtol=0, msg=name)
        assert len(got[name]["buckets"]) > 1, (name, got[name]["buckets"])  # rows moved to a smaller bucket


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_compile_traces_the_step_whole(monkeypatch):
    """What capture="compile" hands to torch.compile (fullgraph=True: a graph break fails) traces whole and
    decodes the eager loop's tokens. Compiled here by dynamo and AOT autograd without inductor's code
    generation ("aot_eager"): the trace is what this checks, and inductor's C++ build of it took ~40 s of
    the suite on the CPU; the GPU tests run the real reduce-overhead compile."""
    real_compile = torch.compile

    def traced(fn, mode=None, **kwargs):
        assert mode == "reduce-overhead" and kwargs.get("fullgraph") is True, (mode, kwargs)
        return real_compile(fn, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", traced)
    model = tiny_decoder("mistral-window")
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, n=2)  # one bucket, no EOS
    want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS)
    gen = Generator(model, PAD, decode="static", capture="compile")
    gen.static._mode = lambda device: "compile"
    _assert_same(gen.generate(ids, mask, params, row_keys=KEYS), want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_keyed_draw_equals_the_eager_one():
    """The keyed draw a CUDA graph captures compiled (fuse_noise) picks the eager draw's tokens; here
    compiled for the CPU (the GPU test replays it in the graph). One shape (each costs a compile of ~8 s on
    2 cores): a width that is no multiple of the vector length, so the kernel's tail is drawn too."""
    compiled = static_decode.compiled_keyed_choice()
    g = torch.Generator().manual_seed(1)
    scaled = torch.randn(24, 4099, generator=g) * 2
    scaled[:, ::7] = float("-inf")  # truncated tokens
    keys = torch.randint(0, 2 ** 40, (24,), generator=g)
    assert torch.equal(compiled(scaled, keys), keyed_choice(scaled, keys))


# ---- on a CUDA device (pytest -m gpu) ----

def _cuda_case(family, dtype=torch.float32):
    model = tiny_decoder(family).to(dtype).cuda()
    ids, mask = left_padded_prompts(model.cfg.vocab_size)
    return model, ids, mask


@pytest.mark.gpu
@pytest.mark.parametrize("greedy", [True, False])
def test_cuda_graph_replay_equals_the_eager_loop(family, greedy):
    """float32 on the GPU: the step captured as a CUDA graph replays the eager loop's tokens, rows ending
    unevenly and moving to smaller buckets (each captured on first use)."""
    model, ids, mask = _cuda_case(family)
    params = _params(greedy)
    want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS)
    gen = Generator(model, PAD, decode="static")  # capture="graph" on CUDA ("auto" would fall back on errors)
    got = gen.generate(ids, mask, params, row_keys=KEYS)
    assert gen.static.captures >= 2 and len(gen.static.states) >= 2
    assert all(hasattr(st, "graph") for st in gen.static.states.values())
    _assert_same(got, want, atol=1e-4)
    _assert_same(gen.generate(ids, mask, params, row_keys=KEYS), want, atol=1e-4)  # replayed again


@pytest.mark.gpu
def test_cuda_reduce_overhead_equals_the_eager_loop(monkeypatch):
    """capture="compile": torch.compile(mode="reduce-overhead") of the same step, one bucket (one compile;
    ended rows stay, masked), gives the eager loop's tokens on two calls."""
    monkeypatch.setattr(static_decode, "COMPACT_AT", 2.0)
    model, ids, mask = _cuda_case("llama-gqa")
    params = _params(False)
    want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS)
    gen = Generator(model, PAD, decode="static", capture="compile")
    for _ in range(2):
        _assert_same(gen.generate(ids, mask, params, row_keys=KEYS), want, atol=1e-4)
    assert gen.static.captures == 1


@pytest.mark.gpu
def test_auto_takes_the_static_path_on_cuda():
    model, ids, mask = _cuda_case("llama-gqa")
    gen = Generator(model, PAD)
    params = _params(False)
    got = gen.generate(ids, mask, params, row_keys=KEYS)
    assert gen.static_failed is None and gen.static.captures >= 1
    _assert_same(got, Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS), atol=1e-4)


@pytest.mark.gpu
def test_cuda_bfloat16_log_probs_within_tolerance():
    model, ids, mask = _cuda_case("llama-gqa", torch.bfloat16)
    params = _params(False, n=4)
    want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS)
    got = Generator(model, PAD, decode="static").generate(ids, mask, params, row_keys=KEYS)
    _assert_bf16_close(got, want)


@pytest.mark.gpu
def test_cuda_graph_sees_weights_copied_in_place():
    """A captured CUDA graph replays on the parameters' storage: after an in-place copy of other weights the
    same graphs (no new capture) decode the other model's tokens."""
    model, ids, mask = _cuda_case("qwen2-bias-tied")
    params = _params(True)
    gen = Generator(model, PAD, decode="static")
    before = gen.generate(ids, mask, params).responses
    captures = gen.static.captures
    other = tiny_decoder("qwen2-bias-tied", seed=5).cuda()
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)
    after = gen.generate(ids, mask, params)
    assert gen.static.captures == captures
    _assert_same(after, Generator(other, PAD, decode="python").generate(ids, mask, params), atol=1e-4)
    assert not torch.equal(before, after.responses)


@pytest.mark.gpu
def test_cuda_graphs_survive_families_alternating_as_in_training():
    """The trainer's pattern: validation (greedy), then training steps (keyed sampling), then validation
    again, each family dropping the other's graphs and capturing its own; every call equals the eager loop
    (the first GPU run of the demo hit the allocator's `use_count > 0` assert here and fell back to eager)."""
    model, ids, mask = _cuda_case("llama-gqa")
    gen = Generator(model, PAD, decode="static")
    for greedy in (True, False, False, True, False):
        params = _params(greedy)
        want = Generator(model, PAD, decode="python").generate(ids, mask, params, row_keys=KEYS)
        _assert_same(gen.generate(ids, mask, params, row_keys=KEYS), want, atol=1e-4)
    assert gen.static_failed is None
