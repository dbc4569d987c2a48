"""What a config cannot run on a model with experts is one ConfigError naming the key, before any worker starts."""
import pytest

from hybridflow.config.loader import load_config
from hybridflow.config.plan import RunPlan
from hybridflow.config.validate import check_plan
from hybridflow.errors import ConfigError
from hybridflow.models.config import DecoderConfig, ModelConfigError, UnsupportedArchitecture

DENSE = dict(model_type="qwen3", vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
MOE = {**DENSE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "norm_topk_prob": True}


EP2 = ["trainer.n_devices=2", "trainer.launcher=ray"]


def check(model: dict, *overrides: str) -> None:
    cfg = load_config(None, ["model.path=/models/tiny", "data.train_files=[a.parquet]", *overrides])
    check_plan(cfg, RunPlan.from_config(cfg), DecoderConfig.from_hf_dict(model))


@pytest.mark.parametrize("model, overrides, key, message", [
    ({**MOE, "moe_intermediate_size": 33}, ["trainer.n_devices=2", "trainer.launcher=ray", "actor.parallel.tp=2",
                                            "actor.parallel.sequence_parallel=true"],
     "actor.parallel.tp", "2 does not divide the model's 33 expert MLP features"),
    (MOE, ["trainer.n_devices=2", "trainer.launcher=ray", "actor.parallel.tp=2"],
     "actor.parallel.sequence_parallel", "only with sequence parallelism"),
    (DENSE, ["actor.moe.aux_loss_coeff=0.01"], "actor.moe.aux_loss_coeff", "has no experts"),
    (MOE, ["actor.moe.z_loss_coeff=-1"], "actor.moe.z_loss_coeff", "negative"),
    (MOE, ["actor.moe.aux_loss_coeff=0.01", "actor.engine=fsdp", "reference.engine=fsdp"],
     "actor.moe.aux_loss_coeff", "only the megatron engine adds router losses"),
    (DENSE, ["actor.moe.routing_replay=rollout"], "actor.moe.routing_replay", "has no experts"),
    (MOE, ["actor.moe.routing_replay=old", "actor.engine=fsdp", "reference.engine=fsdp"],
     "actor.moe.routing_replay", "replayed in megatron-core's routers"),
    (MOE, ["actor.moe.routing_replay=rollout", "rollout.engine=vllm"], "actor.moe.routing_replay",
     "rollout.engine=vllm does not record the experts"),
    (MOE, ["actor.moe.routing_replay=rollout", "rollout.record_routes=false"], "actor.moe.routing_replay",
     "rollout.record_routes is false"),
    (MOE, ["actor.moe.routing_replay=rollout", "env.function=calculator"], "actor.moe.routing_replay",
     "multi-turn rollouts"),
    (MOE, ["actor.moe.routing_replay=old", "actor.log_prob_share_prompts=true"], "actor.moe.routing_replay",
     "routes once per shared prompt"),
    (MOE, ["algorithm.adv_estimator=gae", "critic.moe.routing_replay=rollout"], "critic.moe.routing_replay",
     "routing replay is the actor's"),
    (DENSE, [*EP2, "actor.parallel.ep=2"], "actor.parallel.ep", "has no experts"),
    (MOE, [*EP2, "actor.parallel.ep=3"], "actor.parallel.ep", "3 does not divide the model's 4 experts"),
    ({**MOE, "num_experts": 8}, [*EP2, "actor.parallel.cp=2", "actor.parallel.ep=4"], "actor.parallel.ep",
     r"4 does not divide the 2 data- x context-parallel ranks of the actor \(dp=1, cp=2\)"),
    ({**MOE, "num_experts": 8}, [*EP2, "actor.parallel.ep=4"], "actor.parallel.ep", "4 does not divide the 2"),
    (MOE, [*EP2, "actor.parallel.ep=2", "actor.engine=fsdp", "reference.engine=fsdp"], "actor.parallel.ep",
     "split over ranks by megatron-core"),
    (MOE, [*EP2, "actor.parallel.ep=2", "algorithm.adv_estimator=gae"], "critic.parallel.ep",
     "one megatron-core layout"),
])
def test_what_an_moe_model_cannot_run_is_refused_by_key(model, overrides, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        check(model, *overrides)
    assert info.value.path == key


def test_an_moe_model_with_coefficients_passes():
    check(MOE, "actor.moe.aux_loss_coeff=0.01", "actor.moe.z_loss_coeff=0.001")


@pytest.mark.parametrize("mode", ["rollout", "old"])
def test_routing_replay_on_an_moe_model_passes_and_old_keeps_the_old_log_prob_pass(mode):
    from hybridflow.config.plan import needs_old_log_probs

    check(MOE, f"actor.moe.routing_replay={mode}")
    cfg = load_config(None, ["model.path=/models/tiny", "data.train_files=[a.parquet]",
                             f"actor.moe.routing_replay={mode}"])
    plain = load_config(None, ["model.path=/models/tiny", "data.train_files=[a.parquet]"])
    assert not needs_old_log_probs(plain)  # the default update takes its own log-probs as the old ones
    assert needs_old_log_probs(cfg) == (mode == "old")  # "old" replays what that pass records


@pytest.mark.parametrize("patch, error, message", [
    ({"model_type": "deepseek_v3"}, UnsupportedArchitecture, "model_type 'deepseek_v3' is not supported"),
    ({"mlp_only_layers": [0]}, UnsupportedArchitecture, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, UnsupportedArchitecture, "decoder_sparse_step"),
    ({"num_experts_per_tok": 5}, ModelConfigError, "exceeds num_experts=4"),
    ({"num_experts": 0}, ModelConfigError, "num_experts=0: must be a positive integer"),
    ({"model_type": "mixtral", "num_local_experts": 4, "router_jitter_noise": 0.1}, UnsupportedArchitecture,
     "router_jitter_noise"),
])
def test_expert_fields_the_decoder_does_not_build_are_named(patch, error, message):
    """(The trainer turns these into a ConfigError naming model.path before any worker starts.)"""
    with pytest.raises(error, match=message):
        DecoderConfig.from_hf_dict({**MOE, **patch})
