"""Config checks of routing replay (`actor.moe.routing_replay`, engine/routes.py) and expert parallelism
(`parallel.ep`, engine/experts.py): each refusal a ConfigError
naming the key, before any worker starts. Called from `validate.check_plan`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.config.plan import RunPlan
from hybridflow.config.schema import Config
from hybridflow.errors import ConfigError

if TYPE_CHECKING:
    from hybridflow.models.config import DecoderConfig

KEY = "actor.moe.routing_replay"


def check_routing_replay(cfg: Config, plan: RunPlan, model: "DecoderConfig") -> None:
    """Replay needs a model with experts trained by megatron-core, and routes to replay: the rollout's (recorded
    by the built-in engine on single-turn rollouts) or the old-log-prob pass's (recorded per row, so not from
    shared-prompt rows, whose prompt is routed once for all of them)."""
    mode = cfg.actor.moe.routing_replay
    if plan.uses_critic and cfg.critic.moe.routing_replay != "off":
        raise ConfigError("critic.moe.routing_replay", "routing replay is the actor's (the critic trains on "
                          "routes of its own); set actor.moe.routing_replay")
    if mode == "off":
        return
    if not model.is_moe:
        raise ConfigError(KEY, f"{mode!r}: the actor's model has no experts (a dense {model.model_type})")
    if plan.engines["training"] != "megatron":
        raise ConfigError(KEY, f"{mode!r}: routes are replayed in megatron-core's routers; actor.engine is "
                               f"{plan.engines['training']!r}")
    if mode == "rollout":
        if cfg.rollout.engine != "builtin":
            raise ConfigError(KEY, f"'rollout': rollout.engine={cfg.rollout.engine} does not record the experts "
                                   "it routes to (the built-in engine does); use 'old' or rollout.engine=builtin")
        if not cfg.rollout.record_routes:
            raise ConfigError(KEY, "'rollout' replays the routes the rollout records; rollout.record_routes is false")
        if cfg.env.function is not None:
            raise ConfigError(KEY, "'rollout': multi-turn rollouts (env.function) do not record routes; use 'old'")
    if mode == "old" and cfg.actor.log_prob_share_prompts:
        raise ConfigError(KEY, "'old' records each row's routes in the old-log-prob pass, which "
                               "actor.log_prob_share_prompts=true routes once per shared prompt; turn one off")


def check_expert_parallel(cfg: Config, plan: RunPlan, model: "DecoderConfig") -> None:
    """`parallel.ep` > 1 (actor, and a critic at the actor's processes): an MoE model on megatron-core whose
    experts ep divides, over the data- and context-parallel ranks of a stage (megatron-core carves the
    expert-parallel groups from them) that ep divides."""
    roles = [("actor", "training", cfg.actor)] + ([("critic", "critic", cfg.critic)] if plan.uses_critic else [])
    for role, engine, section in roles:
        ep, key = section.parallel.ep, f"{role}.parallel.ep"
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise ConfigError(key, f"must be an int >= 1, got {ep!r}")
        if ep == 1:
            continue
        if not model.is_moe:
            raise ConfigError(key, f"{ep}: the model has no experts (a dense {model.model_type})")
        if plan.engines[engine] != "megatron":
            raise ConfigError(key, f"{ep}: experts are split over ranks by megatron-core; {role}.engine is "
                                   f"{plan.engines[engine]!r}")
        if model.num_experts % ep:
            raise ConfigError(key, f"{ep} does not divide the model's {model.num_experts} experts")
        layout = plan.layouts[engine]
        if (layout.dp * layout.cp) % ep:
            raise ConfigError(key, f"{ep} does not divide the {layout.dp * layout.cp} data- x context-parallel ranks "
                                   f"of the {role} (dp={layout.dp}, cp={layout.cp}), which megatron-core splits "
                                   "into expert-parallel groups")
    if plan.uses_critic and plan.colocate_critic and cfg.critic.parallel.ep != cfg.actor.parallel.ep:
        raise ConfigError("critic.parallel.ep", f"{cfg.critic.parallel.ep}: the critic shares the actor's processes, "
                          f"which run one megatron-core layout (actor.parallel.ep={cfg.actor.parallel.ep})")
