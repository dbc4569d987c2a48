"""LoRA on the megatron-core engine (issue 62): the base stays frozen; zero-initialised B is the base model and
the adapters-off reference is the base model; the generation weights are the merged W + s * B A; the adapters'
gradients equal the chain rule through a model whose weights are W + s * B A, at one rank and at tp2 and tp2 with
sequence parallelism (pp2: `test_lora_layouts.py`)."""
import pytest
import torch

from hybridflow.config.schema import ParallelConfig
from hybridflow.engine import MegatronEngine
from tests.engine.conftest import layout_case, write_layout_model
from tests.lora.common import LORA, full_adapters, full_shape, gradient_pass
from tests.torchrun import torchrun

pytestmark = pytest.mark.usefixtures("megatron_world")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return layout_case(write_layout_model(tmp_path_factory.mktemp("lora_model")))


def lora_engine(case, **parallel):
    engine = MegatronEngine(case.cfg, ParallelConfig(**parallel), case.optim, total_steps=10, lora=LORA)
    engine.load_hf_checkpoint(case.path)
    return engine


def merged_engine(case, adapted) -> MegatronEngine:
    """A one-rank engine without adapters whose adapted weights are W + s * B A (`full_adapters`)."""
    plain = MegatronEngine(case.cfg, ParallelConfig(), case.optim, total_steps=10)
    plain.load_hf_checkpoint(case.path)
    params = plain.named_params()
    with torch.no_grad():
        for a in adapted:
            full_a, full_b = full_adapters(a.key, LORA.rank, *full_shape(a, 1))
            params[a.local].add_(LORA.alpha / LORA.rank * full_b @ full_a)
    return plain


def merged_model_gradients(case, adapted) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapter's gradient by the chain rule through a one-rank model without adapters whose adapted
    weights (`adapted`: which layers, their shapes) are W + s * B A (`full_adapters`): dL/dA = s B^T G,
    dL/dB = s G A^T, G = dL/dW by autograd."""
    plain = merged_engine(case, adapted)
    params, scale = plain.named_params(), LORA.alpha / LORA.rank
    adapters = {a.key: full_adapters(a.key, LORA.rank, *full_shape(a, 1)) for a in adapted}
    gradient_pass(plain, case.batch)
    out = {}
    for a in adapted:
        g, (full_a, full_b) = params[a.local].main_grad, adapters[a.key]
        out[a.key] = (scale * full_b.t() @ g, scale * g @ full_a.t())
    return out


def assert_gradients_equal(got: dict, want: dict, what: str) -> None:
    """Each adapter's gradient within 1e-4 of the chain rule's in norm (relative). The two compute (W + s B A) x
    and W x + s B (A x), which round apart: measured 1.5e-6 to 1e-5 on this random model, whose gradients are
    large; a missing TP sum or a wrong shard is off by tens of percent."""
    assert got.keys() == want.keys() and len(want) == 8, (what, sorted(got))
    for key, pair in want.items():
        for name, mine, theirs in zip("AB", got[key], pair):
            assert theirs.abs().max() > 0, (key, name)  # every adapter takes part
            error = float((mine - theirs).norm() / theirs.norm())
            assert error < 1e-4, f"{what} {key} {name}: {error:.2e} relative"


@pytest.mark.slow
def test_one_rank_lora_trains_adapters_only_and_its_adapters_off_reference_is_the_base_model(case):
    """B starts at zero: the log-probs are the base model's (a frozen engine from the same checkpoint). After
    an Adam step only adapters moved, a checkpoint holds only them, the generation weights (views of the
    merged buffers) become W + s * B A at the switch to generation, and the adapters-off reference gives
    the frozen engine's log-probs exactly while the trained actor's differ."""
    from hybridflow.data import fields as F
    from hybridflow.engine.lora import AdaptersOff
    from hybridflow.roles import Actor, Reference
    from hybridflow.config.schema import ReferenceConfig, RolloutConfig
    from hybridflow.hybrid_engine.worker_weights import megatron_generation

    engine = lora_engine(case)
    frozen = MegatronEngine(case.cfg, ParallelConfig(), None)
    frozen.load_hf_checkpoint(case.path)
    base = Reference(ReferenceConfig(log_prob_micro_batch_size=3), frozen).compute_ref_log_probs(case.batch)
    actor = Actor(case.actor_cfg, engine)
    assert torch.equal(actor.compute_log_probs(case.batch, 3)["old_log_probs"], base[F.REF_LOG_PROBS])
    generation = megatron_generation(engine, RolloutConfig())  # views at tp = 1: of the merged buffers
    qkv = dict(generation.model.named_parameters())["layers.0.attn.qkv.weight"]
    base_qkv = qkv.clone()
    before = {k: v.clone() for k, v in engine.named_params().items()}
    trainable = {k for k, p in engine.named_params().items() if p.requires_grad}
    assert trainable == set(engine.lora.adapter_names()) and len(trainable) == 16
    actor.update(case.batch, step=0)
    moved = {k for k, v in engine.named_params().items() if not torch.equal(v, before[k])}
    assert moved and moved <= trainable  # A's gradient is 0 while B is: the B's move first
    assert set(engine.state_dict()["model"]) == trainable  # a checkpoint holds the adapters only
    assert torch.equal(qkv, base_qkv)  # not merged again until the switch to generation
    assert generation.refresh()["lora/merged_bytes"] > 0 and not torch.equal(qkv, base_qkv)
    merged = engine.bridge.megatron_to_generation(engine.lora.merged(engine.named_params()))
    assert all(torch.equal(w, merged[k]) for k, w in generation.model.named_parameters())
    adapters_off = Reference(ReferenceConfig(log_prob_micro_batch_size=3), AdaptersOff(engine))
    assert torch.equal(adapters_off.compute_ref_log_probs(case.batch)[F.REF_LOG_PROBS], base[F.REF_LOG_PROBS])
    assert not torch.equal(actor.compute_log_probs(case.batch, 3)["old_log_probs"], base[F.REF_LOG_PROBS])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adapter_gradients_at_one_rank_tp2_and_tp2_sp_equal_the_merged_models(case, tmp_path):
    """At one rank, and with the adapters sharded with TP as their layer's weight (column-parallel: B split, A replicated; row-
    parallel: A split, B replicated), and with sequence parallelism (h gathered / reduce-scattered over the
    sequence, the replicated adapter's gradient summed over TP): each
    adapter's gradient, its pieces joined, equals the chain rule's through the one-rank merged model; and the
    generation weights the 3D-HybridEngine gathers from these shards at tg = 1 are that model's W + s * B A
    (each shard merged from its own pieces, then gathered).
    Checked to fail without the TP sum of h's gradient (A's gradient is then one rank's share)."""
    torchrun("tests/lora/grad_check.py", 2, tmp_path / "grads.pt", case.path)
    launched = torch.load(tmp_path / "grads.pt")
    engine = lora_engine(case)
    adapted = engine.lora.adapted
    want = merged_model_gradients(case, adapted)
    with torch.no_grad():  # the one-rank LoRA engine, its adapters set alike
        for a in adapted:
            full_a, full_b = full_adapters(a.key, LORA.rank, *full_shape(a, 1))
            a.module.lora_A.copy_(full_a)
            a.module.lora_B.copy_(full_b)
    gradient_pass(engine, case.batch)
    assert_gradients_equal({a.key: (a.module.lora_A.main_grad, a.module.lora_B.main_grad) for a in adapted}, want,
                           "one rank")
    merged = merged_engine(case, adapted)
    merged_weights = merged.bridge.megatron_to_generation(merged.full_state())
    for layout, got in launched.items():
        assert_gradients_equal(got["grads"], want, layout)
        generated = got["generation"]
        assert generated.keys() == merged_weights.keys()
        for name, value in merged_weights.items():
            torch.testing.assert_close(generated[name], value, rtol=1e-6, atol=1e-6, msg=f"{layout} {name}")
