"""The megatron-core engine against the plain decoder and a plain-PyTorch optimizer step."""
import copy

import pytest
import torch

from hybridflow.config.schema import ActorConfig, OptimConfig, ParallelConfig, ReferenceConfig
from hybridflow.data import fields as F
from hybridflow.engine import MegatronEngine, left_align_index, unalign
from hybridflow.kernels import logprob_entropy_reference
from hybridflow.models.bridge import get_bridge
from hybridflow.models.decoder import Decoder
from hybridflow.roles import Actor, Reference
from tests.engine.conftest import assert_one_adam_step_close, grouped_rl_batch, rl_batch, tiny_model

pytestmark = pytest.mark.usefixtures("megatron_world")


def test_left_align_roundtrip():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    x = torch.arange(18).view(3, 6)
    idx = left_align_index(mask)
    aligned = x.gather(1, idx)
    assert aligned[0, :3].tolist() == [2, 3, 4] and aligned[2, :5].tolist() == [13, 14, 15, 16, 17]
    assert torch.equal(unalign(aligned[..., None].float(), idx)[..., 0], x.float())


QWEN3 = {"model_type": "qwen3", "head_dim": 24}
QWEN3_MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "norm_topk_prob": True}
QWEN2_MOE = {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48}


@pytest.mark.parametrize("overrides", [{}, {"model_type": "qwen2", "attention_bias": True,
                                           "tie_word_embeddings": True, "num_key_value_heads": 1},
                                       QWEN3, QWEN3_MOE, QWEN2_MOE])
def test_engine_logits_and_log_probs_equal_decoder(overrides):
    cfg, dec, hf = tiny_model(**overrides)
    if overrides:
        dec.init_weights(std=0.2, seed=1)
        hf = get_bridge(cfg).generation_to_hf(dict(dec.state_dict()))
    engine = MegatronEngine(cfg, ParallelConfig(), None)
    engine.load_hf_state_dict(hf)
    batch = rl_batch(cfg.vocab_size)
    out = engine.run([batch], lambda o, mb: (o.new_zeros(()), {"logits": o}), forward_only=True)[0]["logits"]
    ref = dec(batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert out.shape[-1] == engine.bridge.padded_vocab
    torch.testing.assert_close(out[..., :cfg.vocab_size][real], ref[real], atol=2e-5, rtol=1e-5)

    logp = Reference(ReferenceConfig(log_prob_micro_batch_size=3), engine).compute_ref_log_probs(batch)
    r = batch["responses"].shape[1]
    ref_lp, _ = logprob_entropy_reference(ref[:, -r - 1:-1], batch["responses"])
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(logp[F.REF_LOG_PROBS][mask], ref_lp[mask], atol=2e-5, rtol=1e-5)

    # The fused output layer (the default for the actor and reference): the model hands back hidden
    # states, never logits, and the log-probs are the same (the tied case uses the embedding weight).
    fused = MegatronEngine(cfg, ParallelConfig(), None, fused_output=True)
    fused.load_hf_state_dict(hf)
    hidden = fused.run([batch], lambda o, mb: (o.new_zeros(()), {"out": o}), forward_only=True)[0]["out"]
    assert hidden.shape[-1] == cfg.hidden_size != engine.bridge.padded_vocab
    fused_lp = Reference(ReferenceConfig(log_prob_micro_batch_size=3), fused).compute_ref_log_probs(batch)
    torch.testing.assert_close(fused_lp[F.REF_LOG_PROBS][mask], ref_lp[mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(fused_lp[F.REF_LOG_PROBS][mask], logp[F.REF_LOG_PROBS][mask], atol=1e-5, rtol=0)
    assert not fused_lp[F.REF_LOG_PROBS][~mask].any()  # padded response columns are not computed at all


def _plain_actor_step(dec: Decoder, batch, old_logp, adv, optim: OptimConfig, extra_loss=None):
    """The same PPO step written with the plain decoder and torch.optim.AdamW; `extra_loss(model)`: a term
    added to the loss."""
    from hybridflow.algos import ppo_clip_loss
    model = copy.deepcopy(dec)
    # Megatron exempts 1-D parameters (norms, biases) from weight decay.
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1]},
              {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                            weight_decay=optim.weight_decay)
    logits = model(batch["input_ids"], batch["attention_mask"])
    r = batch["responses"].shape[1]
    logp, _ = logprob_entropy_reference(logits[:, -r - 1:-1], batch["responses"])
    loss = ppo_clip_loss(logp, old_logp, adv, batch["response_mask"]).loss
    if extra_loss is not None:
        loss = loss + extra_loss(model)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
    opt.step()
    return model, grad_norm.item()


@pytest.mark.parametrize("micro,fused,tied,packed,shared,overrides", [
    (4, False, False, 0, False, {}), (2, False, False, 0, False, {}), (2, True, False, 0, False, {}),
    (2, True, True, 0, False, {}), (4, True, False, 10, False, {}), (4, False, False, 10, False, {}),
    (8, True, False, 0, True, {}), (5, False, True, 0, True, {}), (2, True, False, 0, False, QWEN3),
    (2, True, False, 0, False, QWEN3_MOE), (4, False, False, 10, False, QWEN2_MOE)])
def test_one_actor_step_matches_plain_pytorch(micro, fused, tied, packed, shared, overrides):
    """packed: token-budgeted micro-batches of <= 10 real tokens (the rows hold 9, 5, 5 and 4), each run as
    one row with a block-diagonal mask: [9], [5, 5], [4]. shared: 8 rows of 4 prompts (GRPO's groups),
    each micro-batch's rows with one prompt run as one row, the prompt computed once. overrides: Qwen3's
    QK-norm, and experts (the router's gradient included; no load-balancing loss, as the plain step has
    none)."""
    cfg, dec, hf = tiny_model(tie_word_embeddings=tied, **overrides)
    # Adam's first step is lr * g / (|g| + eps): with eps 1e-8 a gradient of ~1e-9, which is summation noise
    # (the engine's one-pass kernels and torch's ops round differently), moved a weight by 0.07 lr. eps 1e-6
    # keeps such noise out of the comparison; the step's math is the same.
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, eps=1e-6)
    engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10, fused_output=fused)
    engine.load_hf_state_dict(hf)
    # On CPU the Adam step is torch's fused kernel (use_fused_adam), compared below with the per-tensor loop.
    assert [g["fused"] for g in engine.optimizer.optimizer.param_groups] == [True, True]
    batch = grouped_rl_batch(cfg.vocab_size) if shared else rl_batch(cfg.vocab_size)
    actor = Actor(ActorConfig(optim=optim, ppo_mini_batch_size=len(batch["responses"]), ppo_micro_batch_size=micro,
                              use_dynamic_bsz=packed > 0, ppo_max_token_len_per_gpu=packed or 16384,
                              share_prompts=shared), engine)
    old = actor.compute_log_probs(batch, micro_batch_size=micro, max_tokens=packed, share_prompts=shared)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    # Off-policy old log-probs so that some ratios are clipped.
    old_logp = old[F.OLD_LOG_PROBS] + 0.3 * torch.randn(adv.shape, generator=g)
    metrics = actor.update({**batch, F.OLD_LOG_PROBS: old_logp, F.ADVANTAGES: adv}, step=0)
    assert metrics["actor/grad_norm"] > 0.5  # the clip is active
    expected, grad_norm = _plain_actor_step(dec, batch, old_logp, adv, optim)
    assert metrics["actor/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    got = engine.hf_state_dict()
    want = get_bridge(cfg).generation_to_hf(dict(expected.state_dict()))
    assert set(got) == set(want)
    assert_one_adam_step_close(got, want, hf, optim.lr)
    moved = sum((got[n] - hf[n]).abs().max().item() > 1e-4 for n in hf)
    assert moved == len(hf)


def _router_losses(model: Decoder, ids, real, aux: float, z: float):
    """aux * Switch's load-balancing loss + z * the router z-loss, summed over the MoE layers, as megatron-core
    defines them over the real tokens of `ids` [b, s] (`real` [b, s]: not padding). Per layer, E * sum_i f_i
    * P_i with f_i the share of the T * k routed pairs expert i took and P_i its mean softmax probability;
    and the mean of logsumexp(router logits)^2."""
    logits = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out: logits.append(out)) for layer in model.layers]
    model(ids)
    for hook in hooks:
        hook.remove()
    cfg, total = model.cfg, 0.0
    for layer_logits in logits:
        layer_logits = layer_logits.reshape(*real.shape, -1)[real].float()
        probs = layer_logits.softmax(-1)
        chosen = probs.topk(cfg.moe_top_k, dim=-1).indices
        share = torch.nn.functional.one_hot(chosen, cfg.num_experts).sum((0, 1)) / chosen.numel()
        total = total + aux * cfg.num_experts * (share * probs.mean(0)).sum()
        total = total + z * (torch.logsumexp(layer_logits, -1) ** 2).mean()
    return total


def test_router_losses_add_their_gradients_and_are_reported():
    """actor.moe's coefficients: megatron-core adds the load-balancing and z losses of every MoE layer (over
    the micro-batch's real tokens: the engine marks its padding columns) to the update's gradient. One step's
    weights equal the plain decoder's step on the PPO loss + those terms (autograd), which differs from the
    step without them; the update reports both losses (unscaled) and each layer's loads."""
    from hybridflow.engine.packing import left_align_index

    cfg, dec, hf = tiny_model(**QWEN3_MOE)
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, eps=1e-6)
    aux, z = 0.5, 0.05
    engine = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10, aux_loss_coeff=aux, z_loss_coeff=z)
    engine.load_hf_state_dict(hf)
    batch = rl_batch(cfg.vocab_size)
    actor = Actor(ActorConfig(optim=optim, ppo_mini_batch_size=4, ppo_micro_batch_size=4), engine)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    old_logp = -2.0 + 0.3 * torch.randn(adv.shape, generator=g)
    metrics = actor.update({**batch, F.OLD_LOG_PROBS: old_logp, F.ADVANTAGES: adv}, step=0)

    aligned = batch["input_ids"].gather(1, left_align_index(batch["attention_mask"]))
    real = torch.arange(aligned.shape[1])[None] < batch["attention_mask"].sum(-1)[:, None]
    with torch.no_grad():
        want_losses = _router_losses(dec, aligned, real, 1.0, 0.0), _router_losses(dec, aligned, real, 0.0, 1.0)
    layers = cfg.num_layers
    assert metrics["moe/aux_loss"] == pytest.approx(float(want_losses[0]) / layers, rel=1e-5)
    assert metrics["moe/z_loss"] == pytest.approx(float(want_losses[1]) / layers, rel=1e-5)
    assert all(1 / cfg.num_experts <= metrics[f"moe/layer{i}/max_load"] <= 1 for i in range(layers))
    assert all(0 <= metrics[f"moe/layer{i}/min_load"] <= 1 / cfg.num_experts for i in range(layers))

    expected, grad_norm = _plain_actor_step(dec, batch, old_logp, adv, optim,
                                            extra_loss=lambda model: _router_losses(model, aligned, real, aux, z))
    _, without = _plain_actor_step(dec, batch, old_logp, adv, optim)
    assert metrics["actor/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert abs(grad_norm - without) > 1e-3 * without  # the router losses moved the gradient
    assert_one_adam_step_close(engine.hf_state_dict(), get_bridge(cfg).generation_to_hf(dict(expected.state_dict())),
                               hf, optim.lr)


@pytest.mark.parametrize("overrides", [{}, QWEN3_MOE])
def test_generation_state_is_a_view_of_training_params(overrides):
    """Every generation tensor (an MoE model's router, each expert and the QK-norms too) is a view of its
    training parameter, and an update is seen through it."""
    cfg, _, hf = tiny_model(**overrides)
    engine = MegatronEngine(cfg, ParallelConfig(), OptimConfig(lr=1e-2), total_steps=10)
    engine.load_hf_state_dict(hf)
    views = engine.generation_state()
    params = engine.named_params()
    assert views["embed.weight"].data_ptr() == params["embedding.word_embeddings.weight"].data_ptr()
    assert views["embed.weight"].shape[0] == cfg.vocab_size
    for e in get_bridge(cfg).entries():
        assert views[e.generation].data_ptr() == params[e.megatron].data_ptr(), e.generation
    watched = "layers.0.mlp.router.weight" if cfg.is_moe else "layers.0.mlp.fc1.weight"
    before = views[watched].clone()
    actor = Actor(ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size=4), engine)
    batch = rl_batch(cfg.vocab_size)
    old = actor.compute_log_probs(batch, 4)
    adv = torch.ones(batch["responses"].shape) * batch["response_mask"]
    actor.update({**batch, **old, F.ADVANTAGES: adv}, step=0)
    after = engine.generation_state()[watched]
    assert not torch.equal(before, views[watched])  # the view saw the update
    assert torch.equal(after, views[watched])


def test_engine_checkpoint_roundtrip_restores_optimizer(tmp_path):
    cfg, _, hf = tiny_model()
    optim = OptimConfig(lr=1e-2)
    batch = rl_batch(cfg.vocab_size)

    def train(engine, steps):
        actor = Actor(ActorConfig(optim=optim, ppo_mini_batch_size=4, ppo_micro_batch_size=4), engine)
        for step in steps:
            old = actor.compute_log_probs(batch, 4)
            adv = torch.full(batch["responses"].shape, 1.0 if step % 2 else -1.0) * batch["response_mask"]
            actor.update({**batch, **old, F.ADVANTAGES: adv}, step=step)

    a = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
    a.load_hf_state_dict(hf)
    train(a, [0, 1])
    torch.save(a.state_dict(), tmp_path / "ckpt.pt")
    train(a, [2, 3])
    b = MegatronEngine(cfg, ParallelConfig(), optim, total_steps=10)
    b.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    train(b, [2, 3])
    for name, value in a.hf_state_dict().items():
        torch.testing.assert_close(b.hf_state_dict()[name], value, atol=1e-6, rtol=1e-6, msg=name)

    # dp = 1: plain Adam even though the config asks for the distributed optimizer (it would shard nothing).
    assert ParallelConfig().distributed_optimizer and not a.distributed_optimizer
    # A shard written by the other optimizer is refused by name, before anything is loaded.
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    state["optimizer_params"] = [{"sharded": "state"}]
    before = {k: v.clone() for k, v in b.hf_state_dict().items()}
    state["model"] = {k: v + 1 for k, v in state["model"].items()}
    with pytest.raises(ValueError, match="written with the distributed optimizer and this run uses none"):
        b.load_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in b.hf_state_dict().items())


class _Payload:
    """What a crafted shard holds: unpickling it calls os.mkdir(target)."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        import os

        return os.mkdir, (self.target,)


def test_a_crafted_shard_is_refused_and_its_payload_never_runs(tmp_path):
    """`trainer.resume=auto` loads each rank's shard: a full unpickle ran a crafted shard's code."""
    from hybridflow.engine import UnsafeCheckpointError

    cfg, _, hf = tiny_model()
    engine = MegatronEngine(cfg, ParallelConfig(), OptimConfig(lr=1e-2), total_steps=10)
    engine.load_hf_state_dict(hf)
    engine.save(tmp_path / "ok")
    engine.load(tmp_path / "ok")  # what `save` writes still loads
    marker = tmp_path / "payload_ran"
    (tmp_path / "bad").mkdir()
    torch.save({"model": _Payload(marker)}, engine.shard_path(tmp_path / "bad"))
    with pytest.raises(UnsafeCheckpointError, match=r"engine_tp0_pp0_dp0.pt: refusing to load .*posix.mkdir"):
        engine.load(tmp_path / "bad")
    assert not marker.exists()


def test_pack_rows_keeps_real_tokens_only_and_blocks_attention_across_sequences():
    from hybridflow.engine.packing import pack_rows, unpack_sequences

    aligned = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [4, 0, 0, 0]])
    lengths = torch.tensor([3, 2, 1])
    ids, positions, mask = pack_rows(aligned, lengths)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 4]] and positions.tolist() == [[0, 1, 2, 0, 1, 0]]
    allowed = ~mask[0, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False]  # 9 sees 8 and itself only
    assert allowed[5].tolist() == [False] * 5 + [True]
    out = unpack_sequences(ids[..., None].float(), lengths, width=4)[..., 0]
    assert torch.equal(out, aligned.float())


def test_pad_columns_hides_the_padding_from_real_columns_and_each_padding_column_sees_itself():
    from hybridflow.engine.packing import pack_rows, pad_columns

    ids, positions, mask = pack_rows(torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([3, 2]))
    assert pad_columns(ids, positions, mask, 5) == (ids, positions, mask)  # 5 columns divide: as they were
    padded_ids, padded_positions, padded = pad_columns(ids, positions, mask, 4)
    assert padded_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]] and padded_positions.shape == (1, 8)
    allowed = ~padded[0, 0]
    assert torch.equal(allowed[:5, :5], ~mask[0, 0]) and not allowed[:5, 5:].any()
    assert torch.equal(allowed[5:], torch.eye(8, dtype=torch.bool)[5:])


def test_share_prompt_rows_computes_each_prompt_once_at_each_tokens_own_position():
    from hybridflow.engine.packing import share_prompt_rows, unshare_rows

    # Left-aligned rows: prompt [5, 6] twice (responses [7, 8] and [9]), prompt [4] once (response [3, 2]).
    aligned = torch.tensor([[5, 6, 7, 8], [4, 3, 2, 0], [5, 6, 9, 0]])
    lengths, prompt_lengths = torch.tensor([4, 3, 3]), torch.tensor([2, 1, 2])
    ids, positions, mask, index = share_prompt_rows(aligned, lengths, prompt_lengths)
    row = {tuple(r[:2]): i for i, r in enumerate(ids.tolist())}
    a, b = row[(5, 6)], row[(4, 3)]
    assert ids[a].tolist() == [5, 6, 7, 8, 9] and positions[a].tolist() == [0, 1, 2, 3, 2]
    assert ids[b, :3].tolist() == [4, 3, 2] and positions[b, :3].tolist() == [0, 1, 2]
    allowed = ~mask[:, 0]
    assert allowed[a, 4].tolist() == [True, True, False, False, True]  # 9 sees its prompt and itself, not 7, 8
    assert allowed[a, 3].tolist() == [True, True, True, True, False]
    assert allowed[a, 1].tolist() == [True, True, False, False, False]
    assert allowed[b, 4].tolist() == [False] * 4 + [True]  # padding sees itself only
    out = unshare_rows(ids[..., None].float(), index)[..., 0]
    assert torch.equal(out, aligned.float())


def _critic_engine(cfg, hf):
    """A critic engine on the tiny model, its value head random (a zero head would make every value 0)."""
    engine = MegatronEngine(cfg, ParallelConfig(), OptimConfig(lr=1e-3), total_steps=10, value_head=True)
    engine.load_hf_state_dict(hf)
    head = engine.named_params()["output_layer.weight"]
    head.data.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    return engine


@pytest.mark.parametrize("fused", [False, True])
def test_shared_prompt_log_probs_and_values_equal_the_padded_ones(fused):
    """Rows that share a prompt, run as one row with the prompt computed once, give the padded path's
    log-probs and values within 1e-5; in one micro-batch or spread over three."""
    from hybridflow.config.schema import CriticConfig
    from hybridflow.roles import Critic

    cfg, _, hf = tiny_model()
    batch = grouped_rl_batch(cfg.vocab_size)
    mask = batch["response_mask"].bool()
    engine = MegatronEngine(cfg, ParallelConfig(), None, fused_output=fused)
    engine.load_hf_state_dict(hf)
    padded = Reference(ReferenceConfig(log_prob_micro_batch_size=8), engine).compute_ref_log_probs(batch)
    for micro in (8, 3):
        shared = Reference(ReferenceConfig(log_prob_micro_batch_size=micro, log_prob_share_prompts=True),
                           engine).compute_ref_log_probs(batch)
        torch.testing.assert_close(shared[F.REF_LOG_PROBS][mask], padded[F.REF_LOG_PROBS][mask], atol=1e-5, rtol=0)
    critic_engine = _critic_engine(cfg, hf)
    values = Critic(CriticConfig(ppo_micro_batch_size=8), critic_engine, mini_batch_size=8).compute_values(batch)
    shared_values = Critic(CriticConfig(ppo_micro_batch_size=8, share_prompts=True), critic_engine,
                           mini_batch_size=8).compute_values(batch)
    torch.testing.assert_close(shared_values[F.VALUES], values[F.VALUES], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_packed_log_probs_and_values_equal_the_padded_ones(fused):
    """#14 item 5: the reference's and the critic's forward passes, packed into token-budgeted micro-batches
    with no padding computed, give the padded path's log-probs and values within 1e-5."""
    from hybridflow.config.schema import CriticConfig
    from hybridflow.roles import Critic

    cfg, _, hf = tiny_model()
    batch = rl_batch(cfg.vocab_size)
    engine = MegatronEngine(cfg, ParallelConfig(), None, fused_output=fused)
    engine.load_hf_state_dict(hf)
    padded = Reference(ReferenceConfig(log_prob_micro_batch_size=4), engine).compute_ref_log_probs(batch)
    for budget in (1, 10, 64):  # one row per micro-batch; [9], [5, 5], [4]; everything in one row
        packed = Reference(ReferenceConfig(log_prob_micro_batch_size=4, log_prob_use_dynamic_bsz=True,
                                           log_prob_max_token_len_per_gpu=budget), engine).compute_ref_log_probs(batch)
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(packed[F.REF_LOG_PROBS][mask], padded[F.REF_LOG_PROBS][mask], atol=1e-5, rtol=0)
    critic_engine = _critic_engine(cfg, hf)
    values = Critic(CriticConfig(ppo_micro_batch_size=4), critic_engine, mini_batch_size=4).compute_values(batch)
    packed_values = Critic(CriticConfig(ppo_micro_batch_size=4, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=10),
                           critic_engine, mini_batch_size=4).compute_values(batch)
    torch.testing.assert_close(packed_values[F.VALUES], values[F.VALUES], atol=1e-5, rtol=0)


def test_megatron_core_loads_on_cpu_without_wrapping_its_fusions_in_torch_compile():
    """cpu_compat imports megatron-core with `torch.compile` as the identity (its 38 wrappers cost about 3 s
    of every process's start) and puts `torch.compile` back; a fused function then runs eagerly, equal."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = "\n".join([
        "import sys, torch",
        "compile_ = torch.compile",
        "from hybridflow.engine import cpu_compat",
        "cpu_compat.apply()",
        "from megatron.core.fusions.fused_bias_swiglu import swiglu",
        "assert torch.compile is compile_, 'torch.compile was not put back'",
        "assert 'torch._dynamo' not in sys.modules, 'a torch.compile wrapper was made'",
        "y = torch.randn(3, 8)",
        "assert torch.equal(swiglu(y), torch.nn.functional.silu(y[:, :4]) * y[:, 4:])",
    ])
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]


def test_gradient_clip_scales_with_one_foreach_op():
    """Without apex, megatron-core's clip scales gradients through cpu_compat's foreach op (the actor-step
    test above checks the clipped update against torch); a scale into other tensors keeps the sources."""
    from megatron.core.optimizer import clip_grads, optimizer

    from hybridflow.engine import cpu_compat

    assert clip_grads.multi_tensor_scale_impl is cpu_compat._foreach_scale
    assert optimizer.multi_tensor_scale_impl is cpu_compat._foreach_scale
    src, dst = [torch.arange(3.0), torch.ones(2)], [torch.zeros(3), torch.zeros(2)]
    cpu_compat._foreach_scale(0, None, [src, dst], 0.5)
    assert torch.equal(dst[0], torch.tensor([0.0, 0.5, 1.0])) and torch.equal(dst[1], torch.full((2,), 0.5))
    assert torch.equal(src[0], torch.arange(3.0))
    cpu_compat._foreach_scale(0, None, [src, src], 2.0)
    assert torch.equal(src[0], torch.tensor([0.0, 2.0, 4.0]))


def test_fused_output_log_probs_in_bfloat16_equal_the_unfused_layer():
    """Below float32 megatron-core's Float16Module returns the hidden states in float32 while the output
    weight stays bfloat16: the fused log-prob must take them (it raised a dtype mismatch on the first GPU run
    of the 0.5B-shaped step) and give the unfused layer's log-probs. Tolerance: both round the logits to
    bfloat16 (the same matmul), the log-softmax in float32 may sum them in another order."""
    cfg, _, hf = tiny_model()
    batch = rl_batch(cfg.vocab_size)
    mask = batch["response_mask"].bool()
    got = {}
    for fused in (False, True):
        engine = MegatronEngine(cfg, ParallelConfig(), None, dtype="bfloat16", fused_output=fused)
        engine.load_hf_state_dict(hf)
        got[fused] = Reference(ReferenceConfig(log_prob_micro_batch_size=3), engine).compute_ref_log_probs(batch)
    assert got[True][F.REF_LOG_PROBS].dtype == torch.float32
    torch.testing.assert_close(got[True][F.REF_LOG_PROBS][mask], got[False][F.REF_LOG_PROBS][mask],
                               atol=1e-4, rtol=1e-4)
