"""Routing replay in megatron-core's routers (engine/routes.py), at one process: the old pass records the experts
the model chooses (the plain decoder's choice), replay routes every token by the given experts (the log-probs
are the decoder's forced to them, and a bypassed replay would give the unforced ones), and the mismatch is
counted against the sampler's routes. Layouts are compared with one process in tests/trainer/test_moe_layouts.py."""
import torch

from hybridflow.config.schema import ActorConfig, ParallelConfig
from hybridflow.data import fields as F
from hybridflow.engine import MegatronEngine
from hybridflow.algos.routes import log_prob_gaps, route_metrics
from hybridflow.kernels import logprob_entropy_reference
from hybridflow.models.bridge import get_bridge
from hybridflow.roles import Actor
from hybridflow.rollout.routes import moe_layers
from tests.engine.conftest import grouped_rl_batch, tiny_model
from tests.engine.test_megatron_engine import QWEN3_MOE


def _decoder_pass(dec, batch, forced=None):
    """The decoder's response log-probs [B, R] and its own top-k per column and layer [B, S, L, k] (-1 on
    padding), routed by `forced` [B, S, L, k] where given."""
    ids, mask = batch[F.INPUT_IDS], batch[F.ATTENTION_MASK]
    layers = moe_layers(dec)
    for i, layer in enumerate(layers):
        layer.routes_out = []
        layer.routes_in = None if forced is None else forced[:, :, i].reshape(-1, forced.shape[-1])
    try:
        logits = dec(ids, mask)
        own = torch.stack([layer.routes_out[0].view(*ids.shape, -1) for layer in layers], 2)
    finally:
        for layer in layers:
            layer.routes_out = layer.routes_in = None
    r = batch[F.RESPONSES].shape[1]
    logp, _ = logprob_entropy_reference(logits[:, -r - 1:-1], batch[F.RESPONSES])
    return logp, own.masked_fill(~mask.bool()[:, :, None, None], -1)


def _random_routes(batch, layers: int, experts: int, k: int, seed: int = 3) -> torch.Tensor:
    """k distinct experts per real column and layer, drawn at random; -1 on padding."""
    g = torch.Generator().manual_seed(seed)
    b, s = batch[F.INPUT_IDS].shape
    draws = torch.rand(b, s, layers, experts, generator=g).argsort(-1)[..., :k]
    return draws.masked_fill(~batch[F.ATTENTION_MASK].bool()[:, :, None, None], -1).short()


def _sets(routes: torch.Tensor) -> torch.Tensor:
    return routes.long().sort(-1).values


def test_the_old_pass_records_the_models_routes_and_replay_routes_by_the_given_ones():
    cfg, dec, _ = tiny_model(**QWEN3_MOE)
    dec.init_weights(std=0.2, seed=1)
    engine = MegatronEngine(cfg, ParallelConfig(), None)
    engine.load_hf_state_dict(get_bridge(cfg).generation_to_hf(dict(dec.state_dict())))
    batch = grouped_rl_batch(cfg.vocab_size)
    mask = batch[F.RESPONSE_MASK].bool()
    plain_logp, own = _decoder_pass(dec, batch)

    # Recorded: the routes the model chooses; measured against routes equal to them: no mismatch.
    old = Actor(ActorConfig(), engine, old_log_probs=True)
    old.cfg.moe.routing_replay = "old"
    got = old.compute_log_probs({**batch, F.ROUTES: own.short()}, micro_batch_size=3)
    assert torch.equal(_sets(got[F.OLD_ROUTES]), _sets(own))
    torch.testing.assert_close(got[F.OLD_LOG_PROBS][mask], plain_logp[mask], atol=2e-5, rtol=1e-5)
    real = batch[F.ATTENTION_MASK].bool()
    assert (got[F.ROUTE_MISMATCH][real] == 0).all() and (got[F.ROUTE_MISMATCH][~real] == -1).all()

    # Replayed: routes drawn at random, which the model would mostly not choose.
    forced = _random_routes(batch, cfg.num_layers, cfg.num_experts, cfg.moe_top_k)
    forced_logp, forced_own = _decoder_pass(dec, batch, forced)
    replay = Actor(ActorConfig(), engine, old_log_probs=True)
    replay.cfg.moe.routing_replay = "rollout"
    got = replay.compute_log_probs({**batch, F.ROUTES: forced}, micro_batch_size=3)
    torch.testing.assert_close(got[F.OLD_LOG_PROBS][mask], forced_logp[mask], atol=2e-5, rtol=1e-5)
    assert (got[F.OLD_LOG_PROBS] - plain_logp)[mask].abs().max() > 1e-2  # replay bypassed would fail above
    # The mismatch: the router's own choice (under the replayed routes of the layers before) against them.
    differ = (_sets(forced_own) != _sets(forced)).any(-1).float()  # [B, S, L]
    want = {"route_mismatch": float(differ[real].mean()), "route_mismatch_tokens": float((differ[real].sum(-1) > 0).float().mean())}
    measured = route_metrics(got[F.ROUTE_MISMATCH])
    assert measured.keys() == want.keys() and 0 < want["route_mismatch"] < 1
    for key in want:  # both are counts over the same tokens, summed in other orders
        assert abs(measured[key] - want[key]) < 1e-6, (key, measured, want)
    gaps = log_prob_gaps(got[F.ROUTE_MISMATCH], got[F.OLD_LOG_PROBS], plain_logp, batch[F.RESPONSE_MASK])
    assert gaps["route_mismatch_log_prob_gap"] > 0


def test_replay_off_changes_nothing_and_still_measures():
    cfg, dec, _ = tiny_model(**QWEN3_MOE)
    engine = MegatronEngine(cfg, ParallelConfig(), None)
    engine.load_hf_state_dict(get_bridge(cfg).generation_to_hf(dict(dec.state_dict())))
    batch = grouped_rl_batch(cfg.vocab_size)
    actor = Actor(ActorConfig(), engine, old_log_probs=True)
    plain = actor.compute_log_probs(batch, micro_batch_size=3)
    assert F.ROUTE_MISMATCH not in plain  # no sampler routes: nothing measured
    forced = _random_routes(batch, cfg.num_layers, cfg.num_experts, cfg.moe_top_k)
    measured = actor.compute_log_probs({**batch, F.ROUTES: forced}, micro_batch_size=3)
    assert torch.equal(measured[F.OLD_LOG_PROBS], plain[F.OLD_LOG_PROBS])  # the same computation
    assert route_metrics(measured[F.ROUTE_MISMATCH])["route_mismatch"] > 0
