"""The FSDP2 engine on Hugging Face `transformers` models (`<role>.fsdp.modeling: transformers`,
engine/fsdp_hf.py) against the same engine on hybridflow's decoder, and at 2 ranks against megatron-core.

The two model codes compute the same function in float32 through different modules (`transformers`'
LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM and hybridflow's `Decoder`); measured here, their
logits agree bit for bit on this CPU, but that is not a contract: outputs are compared within 1e-6 (they are
O(1-10)), an update's metrics within rel 1e-5 and weights after Adam's first step within 5% of the learning
rate (that step is ~lr * sign(grad); a gradient within rounding of 0 may flip sign, test_fsdp_engine.py).
What is only data movement (loading, gathering into the generator, exporting, a checkpoint) is compared
with `==`.
"""
import json

import pytest
import torch

from hybridflow.config.schema import CriticConfig, ParallelConfig, ReferenceConfig
from hybridflow.data import fields as F
from hybridflow.data.batch import rows_for_plan
from hybridflow.engine.fsdp import FSDPEngine
from hybridflow.engine.fsdp_hf import TransformersFSDPEngine
from hybridflow.hybrid_engine.fsdp_gather import FSDPGatheredWeights
from hybridflow.models.bridge import get_bridge
from hybridflow.models.checkpoint import save_hf_checkpoint
from hybridflow.roles import Actor, Critic, Reference
from tests.engine.conftest import assert_one_adam_step_close, dp_case, grouped_rl_batch, tiny_model

pytestmark = [pytest.mark.usefixtures("megatron_world"), pytest.mark.timeout(300)]

SHAPES = {
    "llama": {},  # untied embedding and output layer, GQA
    "qwen2 tied": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], attention_bias=True,
                       tie_word_embeddings=True),  # q/k/v biases, one embedding tensor used first and last
    "mistral window": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=24),  # QK-norm
    # transformers fuses each layer's experts into two tensors in memory; the checkpoint holds one per expert
    "qwen3 moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32),
}


def _checkpoint(tmp_path, shape: str):
    cfg, _, hf = tiny_model(**SHAPES[shape])
    save_hf_checkpoint(hf, cfg.to_hf_dict(), tmp_path / "hf")
    return cfg, hf, tmp_path / "hf"


def _engines(cfg, path, optim=None, value_head=False):
    """The same checkpoint on both model codes, at this process's world (1)."""
    ours = FSDPEngine(cfg, optim, total_steps=10, value_head=value_head)
    ours.load_hf_checkpoint(path)
    theirs = TransformersFSDPEngine(path, cfg, optim, total_steps=10, value_head=value_head)
    theirs.load_hf_checkpoint(path)
    return ours, theirs


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_transformers_model_scores_as_hybridflows_decoder_plain_packed_and_prompt_shared(tmp_path, shape):
    """A frozen reference on each model code: the log-probs of left-padded rows, and (full attention only)
    of packed and prompt-shared micro-batches, which reach `transformers` as a 4-D block-causal mask."""
    cfg, hf, path = _checkpoint(tmp_path, shape)
    ours, theirs = _engines(cfg, path)
    assert {k: v for k, v in theirs.hf_state_dict().items()}.keys() == hf.keys()
    assert all(torch.equal(v, hf[k]) for k, v in theirs.hf_state_dict().items())  # loaded as stored
    batch = grouped_rl_batch(cfg.vocab_size)
    real = batch[F.RESPONSE_MASK].bool()
    windowed = any(w is not None for w in cfg.layer_windows)
    modes = [dict()] if windowed else [dict(), dict(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=64),
                                       dict(log_prob_share_prompts=True)]
    for mode in modes:
        got, want = (Reference(ReferenceConfig(log_prob_micro_batch_size=4, **mode), e).compute_ref_log_probs(batch)
                     for e in (theirs, ours))
        # An expert's tokens are batched in another order by the two codes (transformers: by top-k slot, then
        # token; the decoder: by token), so its matmul rounds them otherwise: 1.4e-6 measured, on log-probs ~5.
        torch.testing.assert_close(got[F.REF_LOG_PROBS][real], want[F.REF_LOG_PROBS][real],
                                   atol=3e-6 if cfg.is_moe else 1e-6, rtol=0, msg=str(mode))
    if windowed:  # the window is the model's: a packed pass would need it inside the block-causal mask
        with pytest.raises(ValueError, match="full attention"):
            Reference(ReferenceConfig(log_prob_share_prompts=True), theirs).compute_ref_log_probs(batch)


@pytest.mark.parametrize("shape", ["llama", "qwen2 tied", "qwen3 moe"])
def test_an_actor_on_transformers_updates_as_on_hybridflows_decoder(tmp_path, shape):
    """One PPO update of each: metrics within rel 1e-5, weights within 5% of the learning rate. The
    generator gathered from each engine holds bit for bit the same weights before the update (the HF
    tensors fused by the bridge = the decoder's own), and after it each holds its engine's trained weights."""
    cfg, hf, path = _checkpoint(tmp_path, shape)
    _, _, batch, optim, actor_cfg = dp_case()
    ours, theirs = _engines(cfg, path, optim)
    if shape == "qwen2 tied":  # still one tensor after sharding: the embedding is the output layer
        model = theirs.module.model
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    generators = [FSDPGatheredWeights(e, bucket_bytes=4096) for e in (ours, theirs)]
    before = [dict(g.model.named_parameters()) for g in generators]
    assert all(torch.equal(before[1][n], t) for n, t in before[0].items())
    metrics = []
    for engine in (ours, theirs):
        actor = Actor(actor_cfg, engine)
        rows, steps = rows_for_plan(batch, actor.plan(len(batch[F.INPUT_IDS]), step=0, replicas=1)[0])
        metrics.append(actor.update_share(rows, steps))
    assert sorted(metrics[0]) == sorted(metrics[1])
    for key, value in metrics[0].items():
        assert metrics[1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert_one_adam_step_close(theirs.hf_state_dict(), ours.hf_state_dict(), hf, optim.lr)
    # The generator refilled from the transformers engine holds its trained HF tensors, fused by the bridge.
    generators[1].release()
    generators[1].refresh()
    fused = dict(get_bridge(cfg).fuse_stream(theirs.hf_state_dict().items()))
    assert all(torch.equal(p, fused[n]) for n, p in generators[1].model.named_parameters())
    assert not all(torch.equal(p, before[0][n]) for n, p in generators[1].model.named_parameters())


def test_a_critic_on_transformers_trains_as_on_hybridflows_decoder(tmp_path):
    """The value model: the base model (no output layer read) and a zero head; values and an update agree."""
    cfg, hf, path = _checkpoint(tmp_path, "llama")
    _, _, batch, optim, _ = dp_case()
    ours, theirs = _engines(cfg, path, optim, value_head=True)
    data = dict(batch)
    data[F.RETURNS] = torch.randn(batch[F.RESPONSES].shape, generator=torch.Generator().manual_seed(3))
    data[F.VALUES] = torch.zeros(batch[F.RESPONSES].shape)
    out = []
    for engine in (ours, theirs):
        critic = Critic(CriticConfig(optim=optim, ppo_micro_batch_size=1), engine, mini_batch_size=4)
        rows, steps = rows_for_plan(data, critic.plan(len(data[F.INPUT_IDS]), step=0, replicas=1)[0])
        metrics = critic.update_share(rows, steps)
        out.append((metrics, critic.compute_values(grouped_rl_batch(cfg.vocab_size))[F.VALUES]))
    for key, value in out[0][0].items():
        assert out[1][0][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(out[1][1], out[0][1], atol=2e-3, rtol=0)  # after one Adam step (see the doc)


def test_a_transformers_checkpoint_resumes_bit_exact_converts_and_is_refused_by_the_other_code(tmp_path):
    """Saved (torch DCP) after one update and loaded into a fresh engine, the next update equals the one of
    the engine that never stopped. `hybridflow reshard` turns the checkpoint into the engine's own HF export.
    The decoder's engine refuses it, naming the key that picks the code."""
    from hybridflow.cli import main
    from hybridflow.models.checkpoint import load_hf_state_dict

    cfg, hf, path = _checkpoint(tmp_path, "qwen2 tied")
    _, _, batch, optim, actor_cfg = dp_case()

    def update(engine, step):
        actor = Actor(actor_cfg, engine)
        rows, steps = rows_for_plan(batch, actor.plan(len(batch[F.INPUT_IDS]), step=step, replicas=1)[0])
        return actor.update_share(rows, steps)

    engine = TransformersFSDPEngine(path, cfg, optim, total_steps=10)
    engine.load_hf_checkpoint(path)
    update(engine, 0)
    saved = tmp_path / "step" / "actor"
    engine.save(saved)
    assert json.loads((saved / "engine.json").read_text())["modeling"] == "transformers"
    resumed = TransformersFSDPEngine(path, cfg, optim, total_steps=10)
    resumed.load(saved)
    exported = engine.hf_state_dict()  # a copy, not the parameters: update 1 below must not change it
    assert update(resumed, 1) == update(engine, 1)
    assert all(torch.equal(v, engine.hf_state_dict()[k]) for k, v in resumed.hf_state_dict().items())
    assert main(["reshard", str(saved), str(tmp_path / "converted"), "--to", "hf", "--config", str(path),
                 "--no-progress"]) == 0
    converted = load_hf_state_dict(tmp_path / "converted")
    assert sorted(converted) == sorted(exported) and all(torch.equal(converted[k], exported[k]) for k in exported)
    with pytest.raises(ValueError, match="modeling.*transformers"):
        FSDPEngine(cfg, optim, total_steps=10).load(saved)


def test_a_transformers_critic_checkpoint_converts_as_the_decoders(tmp_path):
    """A critic's DCP keys on `transformers` (its base model's names, the head beside): `hybridflow reshard`
    gives the same HF tensors as from the decoder engine's critic with the same weights (data movement: `==`)."""
    from hybridflow.cli import main
    from hybridflow.models.checkpoint import load_hf_state_dict

    cfg, hf, path = _checkpoint(tmp_path, "llama")
    ours, theirs = _engines(cfg, path, value_head=True)
    head = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    out = {}
    for name, engine in (("ours", ours), ("theirs", theirs)):
        engine.module.head.weight.to_local().copy_(head)
        engine.save(tmp_path / name / "critic")
        assert main(["reshard", str(tmp_path / name / "critic"), str(tmp_path / f"{name}_hf"), "--to", "hf",
                     "--role", "critic", "--config", str(path), "--no-progress"]) == 0
        out[name] = load_hf_state_dict(tmp_path / f"{name}_hf")
    assert sorted(out["ours"]) == sorted(out["theirs"])
    assert all(torch.equal(out["theirs"][k], v) for k, v in out["ours"].items())


def test_an_actor_on_transformers_at_two_ranks_updates_as_megatron_core_at_one_process(two_process_launch):
    """In the session's two-process launch (tests/engine/fsdp_check.py): each rank reads about half the
    checkpoint, the update at 2 ranks equals megatron-core's at one process (metrics within rel 1e-5, weights
    within 5% of the lr, as test_fsdp_engine.py's), and the generator refreshed after it holds the trained
    tensors, having received exactly the plan's bytes (each HF tensor chunked on its own)."""
    from hybridflow.engine import MegatronEngine

    fsdp = torch.load(two_process_launch["fsdp"])
    cfg, hf, batch, optim, actor_cfg = dp_case()
    engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
    engine.load_hf_state_dict(hf)
    metrics = Actor(actor_cfg, engine).update(batch, step=0)
    assert sorted(fsdp["transformers_metrics"]) == sorted(metrics)
    for key, value in metrics.items():
        assert fsdp["transformers_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert_one_adam_step_close(fsdp["transformers_weights"], engine.hf_state_dict(), hf, optim.lr)
    assert 0.45 < fsdp["transformers_read_fraction"] < 0.56
    assert fsdp["transformers_generation_equals_trained"]
    refresh = fsdp["transformers_refresh"]
    assert refresh["reshard/bytes_received"] == fsdp["transformers_plan_bytes"] == refresh["reshard/plan_bytes"]


def test_a_model_only_transformers_builds_runs_on_the_engine_and_its_generator(tmp_path):
    """GPT-2 (Conv1D layers, learned positions, tied embeddings; `DecoderConfig.native` False): loaded as
    stored, its log-probs of plain, packed and prompt-shared micro-batches agree (one model, three batchings:
    within 1e-6), an update moves it, and the generator refreshed after the update (a whole GPT2LMHeadModel,
    tied again after allocation) holds the trained tensors; the decoder and the bridge refuse it by name."""
    from hybridflow.models.config import DecoderConfig, ModelConfigError
    from hybridflow.models.decoder import Decoder
    from hybridflow.rollout.hf_generate import HFGenerator
    from hybridflow.rollout.sampling import SamplingParams
    from tests.trainer.test_transformers_models import write_gpt2

    path = write_gpt2(tmp_path / "gpt2")
    cfg = DecoderConfig.from_pretrained(path, any_architecture=True)
    assert not cfg.native and cfg.num_layers == 2 and cfg.hidden_size == 64 and cfg.intermediate_size == 256
    for build in (Decoder, get_bridge):
        with pytest.raises(ModelConfigError, match="model_type 'gpt2' is not supported"):
            build(cfg)
    _, _, batch, optim, actor_cfg = dp_case()
    batch = {k: v % cfg.vocab_size if k in (F.INPUT_IDS, F.RESPONSES) else v for k, v in batch.items()}
    engine = TransformersFSDPEngine(path, cfg, optim, total_steps=10)
    engine.load_hf_checkpoint(path)
    from hybridflow.models.checkpoint import load_hf_state_dict

    stored = load_hf_state_dict(path)
    assert all(torch.equal(v, stored[k]) for k, v in engine.hf_state_dict().items())
    real = batch[F.RESPONSE_MASK].bool()
    frozen = TransformersFSDPEngine(path, cfg)
    frozen.load_hf_checkpoint(path)
    plain, packed, shared = (
        Reference(ReferenceConfig(log_prob_micro_batch_size=2, **mode), frozen).compute_ref_log_probs(batch)
        for mode in ({}, dict(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=20),
                     dict(log_prob_share_prompts=True)))
    for other in (packed, shared):
        torch.testing.assert_close(other[F.REF_LOG_PROBS][real], plain[F.REF_LOG_PROBS][real], atol=1e-6, rtol=0)
    generation = FSDPGatheredWeights(engine, bucket_bytes=4096)
    model = generation.model
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, so the refresh fills both
    generation.release()
    actor = Actor(actor_cfg, engine)
    rows, steps = rows_for_plan(batch, actor.plan(len(batch[F.INPUT_IDS]), step=0, replicas=1)[0])
    assert actor.update_share(rows, steps)["actor/grad_norm"] > 0
    generation.refresh()
    trained = engine.hf_state_dict()
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    assert not all(torch.equal(trained[n], stored[n]) for n in trained)
    out = HFGenerator(model, 0).generate(batch[F.INPUT_IDS][:2, :5], batch[F.ATTENTION_MASK][:2, :5],
                                         SamplingParams(max_new_tokens=4, do_sample=False))
    assert out.responses.shape == (2, 4)
