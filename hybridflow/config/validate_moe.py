"""Config checks of routing replay (`actor.moe.routing_replay`, engine/routes.py): each refusal a ConfigError
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
