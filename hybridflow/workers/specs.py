"""The parts of the config each worker is handed (rule 5, docs/conventions.md: each component gets only its part).

The trainer builds these from the whole `Config` and its run plan
(`trainer/build.py`); a worker never sees sections it does not use. Values
several sections decide together (the layout, the LR schedule's length, the
critic's mini-batch in responses) are computed once in the run plan
(`config/plan.py`) and arrive here as plain numbers and a `ParallelDims`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from hybridflow.config.schema import (ActorConfig, CriticConfig, EnvConfig, LoRAConfig, ModelConfig,
                                      ReferenceConfig, RewardConfig, RolloutConfig)
from hybridflow.parallel.layout import ParallelDims


@dataclass(frozen=True)
class Run:
    """What every worker of a run shares."""

    device: str  # "cpu" | "cuda"
    seed: int
    # Processes the run starts on the machine's cores (under Ray every device index is one; groups apart
    # each have their own): a CPU worker's torch threads are its share of them (`prepare_process`).
    processes: int = 1
    # trainer.data_plane "object_store" in a Ray run: a worker leaves the token tensors ([B, R] and wider) and
    # texts of what it returns in the object store, and the driver passes references
    # (`controller.transfer.remote_fields`); the workers that read the rows next fetch them from there.
    rows_in_object_store: bool = False


@dataclass(frozen=True)
class RuleReward:
    """reward.function (as configured: errors name it so), which a generating worker scores each response
    with (`roles.scoring`). `fn`: the function the trainer found under a registered name, passed along (it
    may have been registered in the driver's process only, by `register_reward`); `resolved`: a
    "file.py:function" with the file's absolute path, which the worker loads itself."""

    function: str = "default"
    fn: Optional[Callable] = None
    resolved: Optional[str] = None
    config: Optional[RewardConfig] = None  # the reward section: kind, time limit, processes (`build_scorer`)

    def load(self) -> Callable:
        """The function, or with `config` the scorer (`roles.scoring.build_scorer`) that runs it with a time limit."""
        from hybridflow.rewards import get_reward_fn

        fn = self.fn if self.fn is not None else get_reward_fn(self.resolved or self.function)
        if self.config is None:
            return fn
        from hybridflow.roles.scoring import build_scorer

        return build_scorer(self.config, fn)


@dataclass(frozen=True)
class ActorWorkerSpec:
    """The actor, its rollout and (when KL is used) the reference, in one process."""

    run: Run
    model: ModelConfig
    actor: ActorConfig
    rollout: RolloutConfig
    reference: Optional[ReferenceConfig]  # None: no KL term, so no reference engine; its `parallel` is resolved
    max_response_length: int  # data.max_response_length: new tokens per response
    optimizer_steps: int  # the LR schedule's length
    layout: ParallelDims  # the actor's (and reference's) p-t-d layout over the group: the engines' own
    generates: bool = True  # False when a rollout group apart generates: no generation weights here
    old_log_probs: bool = True  # an old log-prob pass runs before each update (`roles.actor.update_fields`)
    env: EnvConfig = field(default_factory=EnvConfig)  # a multi-turn rollout's environment (none: single-turn)
    reward: RuleReward = field(default_factory=RuleReward)  # the rule reward, scored where a rollout is made


@dataclass(frozen=True)
class RolloutWorkerSpec:
    """Rollout on devices apart from training, at rollout.tg."""

    run: Run
    model: ModelConfig
    rollout: RolloutConfig
    max_response_length: int
    train_layout: ParallelDims  # the actor's layout, whose shards it receives (and whose padded vocabulary)
    lora: Optional[LoRAConfig] = None  # a megatron actor's LoRA adapters: after the first sync only they cross
    reward: RuleReward = field(default_factory=RuleReward)
    env: EnvConfig = field(default_factory=EnvConfig)


@dataclass(frozen=True)
class ReferenceWorkerSpec:
    """The frozen reference on devices of its own, under FSDP (reference.engine=fsdp)."""

    run: Run
    model: ModelConfig
    reference: ReferenceConfig
    temperature: float  # rollout.temperature: the log-probs are of the distribution sampled from
    layout: ParallelDims  # dp = the group's processes


@dataclass(frozen=True)
class CriticWorkerSpec:
    run: Run
    model: ModelConfig  # dtype and vocabulary padding of the actor's model
    path: str  # critic.model_path, or the actor's model.path
    critic: CriticConfig
    mini_batch_size: int  # responses per optimizer step (actor.ppo_mini_batch_size * rollout.n)
    optimizer_steps: int
    layout: ParallelDims
