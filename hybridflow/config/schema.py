"""Typed configuration: one dataclass per component, composed into `Config`.

YAML is only a serialization of these classes (see `loader.py`); code reads
typed attributes, and each component is handed only its own section
(`PromptDataset(cfg.data, ...)`, `Actor(cfg.actor, ...)`). Defaults describe a
small single-process CPU run; the files in `configs/` override them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

# The rollout engines (rollout.engine, `Node(engine=...)`, `load_hf_model(engine=...)`): the one list of their
# names; `hybridflow.rollout.factory` builds each.
EngineName = Literal["builtin", "vllm"]
ENGINES: tuple[str, ...] = get_args(EngineName)

# The metrics backends trainer/tracking.py builds (its LOGGERS): checked by the loader like any choice.
LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]


@dataclass
class ModelConfig:
    """The actor's HF checkpoint directory (config.json + safetensors)."""

    path: str = ""
    tokenizer_path: Optional[str] = None  # defaults to `path`
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Megatron pads the vocabulary to a multiple of this times TP.
    make_vocab_size_divisible_by: int = 128
    # The actor's and reference's log-probs straight from the final hidden states (verl's name): the output
    # layer runs fused with the log-prob on response positions only, never holding [tokens, vocab] logits.
    # At tp > 1 the vocab-parallel logits path is used whatever this says.
    use_fused_kernels: bool = True
    # On CPU, the layers' RMSNorm, SwiGLU and RoPE run hybridflow's one-pass C++ kernels, forward and backward
    # (megatron-core runs them unfused without Transformer Engine); false keeps megatron-core's own ops.
    cpu_layer_kernels: bool = True


@dataclass
class DataConfig:
    """Prompt datasets in verl's column convention (parquet or jsonl)."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    max_prompt_length: int = 512
    max_response_length: int = 512
    overlong_prompts: Literal["filter", "truncate_left", "truncate_right", "error"] = "filter"
    train_batch_size: int = 32
    val_batch_size: int = 256
    val_max_samples: int = 0  # validate on the first N validation prompts; 0: all of them
    shuffle: bool = True
    seed: int = 0
    apply_chat_template: bool = True
    # A prompt whose samples all scored the same (no GRPO signal) is skipped on its next N passes over the
    # data; 0: every prompt every epoch, in an order fixed by (seed, step). See hybridflow/data/sampler.py.
    skip_uniform_passes: int = 0
    # Only groups that all scored at least this are skipped (1.0: solved prompts, with 0/1 rewards);
    # null: any uniform group, all wrong ones too.
    skip_uniform_min_score: Optional[float] = None


@dataclass
class ParallelConfig:
    """Training layout p-t-d(-c); dp is derived from the number of processes."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    virtual_pp: Optional[int] = None  # model chunks per pipeline stage (interleaved schedule); needs pp >= 2
    # Expert parallelism (an MoE model, megatron-core engine): each layer's experts split over ep of the
    # data-parallel ranks, tokens reaching them through the allgather dispatcher (engine/experts.py).
    ep: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True  # shard Adam state over DP ranks; applies only where dp > 1


# Which training engine holds a role's model (`hybridflow/engine/`): megatron-core at its parallel layout, or
# FSDP2 (`engine/fsdp.py`), sharding every tensor over the role's devices (data parallel only).
TrainEngineName = Literal["megatron", "fsdp"]
TRAIN_ENGINES: tuple[str, ...] = get_args(TrainEngineName)


@dataclass
class FSDPConfig:
    """Settings of a role under FSDP2 (its `engine: fsdp`)."""

    # Keep parameters, gradients and Adam state in CPU memory between uses (torch's CPUOffloadPolicy): a
    # GPU run trades transfer time for device memory. On the CPU they are there already (refused).
    offload: bool = False
    # Whose code computes the model: hybridflow's decoder, or the `transformers` class its config.json names
    # (LlamaForCausalLM, ...), sharded the same way (engine/fsdp_hf.py); both compute the same function.
    modeling: Literal["hybridflow", "transformers"] = "hybridflow"


@dataclass
class MoELossConfig:
    """A mixture-of-experts model's router losses (megatron-core engine; a dense model takes none): the
    load-balancing loss (Switch Transformer's, per micro-batch) and the router z-loss, each weighted by its
    coefficient and added to the role's loss (0: off). `moe/...` metrics report both and each layer's
    most and least loaded expert every step."""

    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    # Routing replay (actor only; megatron-core engine, engine/routes.py): "rollout" routes the old-log-prob pass
    # and the update by the experts the rollout chose (ROUTES, recorded by the built-in engine); "old" records
    # the old-log-prob pass's choices and routes the update by them; "off" lets the trainer route. Either way
    # moe/route_mismatch reports how often the trainer's own choice differs from the sampler's.
    routing_replay: Literal["off", "rollout", "old"] = "off"


# The parallel linears a LoRA adapter may sit on (`engine/lora.py`), by megatron-core's module names.
LORA_TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the actor's parallel linears (megatron-core engine; rank 0: off, every weight
    trains). Each adapted layer computes W x + (alpha / rank) * B A dropout(x), with A [rank, in] and
    B [out, rank] (B starts at zero, so step 0 is the base model); the base weights are frozen: no
    gradient, no optimizer state. `reference.engine: adapters_off` then makes the KL reference the
    actor's own forward with the adapters switched off."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapters' input; 0 in RL by default, as for the model itself
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"


@dataclass
class RolloutConfig:
    """Generation: engine, sampling and the generation layout (pg-tg)."""

    engine: EngineName = "builtin"
    # The actor's weights reach an engine that keeps its own copy (vLLM) as (HF name, tensor) buckets of at most
    # this many MiB, one transfer each: no second whole model is built on the way.
    weight_bucket_mb: int = 64
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    do_sample: bool = True
    stop: list[str] = field(default_factory=list)
    tg: int = 1  # generation tensor parallel size; must divide actor.parallel.tp
    pg: int = 1  # generation pipeline size; must divide actor.parallel.pp (only 1 is built)
    # How the 3D-HybridEngine regroups training shards into generation shards (docs/design.md §3):
    # "hybridflow" (the paper's micro-DP gather), "vanilla" (HybridFlow-V) or "full" (gather everything).
    grouping: Literal["hybridflow", "vanilla", "full"] = "hybridflow"
    batch_size_per_device: Optional[int] = None
    pad_to_max_length: bool = False
    val_temperature: float = 0.0  # greedy validation
    # An MoE model's experts per token and layer, recorded by the built-in engine (ROUTES): what the trainer
    # measures its route mismatch against, and replays (actor.moe.routing_replay=rollout). It generates on the
    # Python loop then (the C++ and CUDA-graph loops keep no routes).
    record_routes: bool = True


LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


@dataclass
class TrainedRoleConfig:
    """What the roles trained by PPO-style updates (actor, critic) share: optimizer, layout, micro-batches."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: TrainEngineName = "megatron"  # "fsdp": parallel must stay at tp = pp = cp = 1
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoELossConfig = field(default_factory=MoELossConfig)
    ppo_micro_batch_size: int = 8  # in sequences, per device
    # Sequence packing (verl's dynamic batch size): micro-batches (the update's, and the critic's values pass)
    # hold up to this many real tokens each, packed into one row with no padding computed, instead of a fixed
    # number of sequences (pp = 1 only).
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    # Rows that share a prompt (GRPO's n samples) run as one row: the prompt computed once, each response
    # attending to it (pp = 1, cp = 1, full attention; not with the dynamic batch size above).
    share_prompts: bool = False
    ppo_epochs: int = 1
    loss_agg_mode: LossAggMode = "token-mean"


@dataclass
class LogProbConfig:
    """Micro-batches of a forward-only log-prob pass (the actor's old log-probs, the reference's): sequences
    per device, or packed or shared-prompt rows as in `TrainedRoleConfig`."""

    log_prob_micro_batch_size: int = 16
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    log_prob_share_prompts: bool = False


@dataclass
class ActorConfig(LogProbConfig, TrainedRoleConfig):
    """Policy training: PPO-style mini-batches over the rollout batch; `log_prob_*`: its old log-probs' pass."""

    policy_loss: str = "ppo"  # name in the algorithms registry
    ppo_mini_batch_size: int = 32  # in prompts, as verl counts it
    # With one epoch over one mini-batch (and no KL in the reward) the old log-probs are the current
    # policy's: the update takes them from its own forward pass (detached) instead of a pass of their own.
    skip_old_log_probs: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl", "abs", "mse"] = "low_var_kl"
    # The gap between the sampler (ROLLOUT_LOG_PROBS: the rollout engine's, of weights that may be versions
    # behind under trainer.off_policy) and the trainer's recomputed old log-probs (the proximal policy). The
    # clip stays around the proximal policy; each token's loss is weighted by w = pi_prox / pi_behaviour:
    # "decoupled" (AReaL's decoupled PPO) as it is, "tis" truncated at the threshold, "mis" masked (0) above
    # it; "none": no weight (the PPO of today). The level says whether w is per token or one per sequence
    # (the product of its tokens' ratios). algos/losses.py: behaviour_weights.
    off_policy_correction: Literal["none", "decoupled", "tis", "mis"] = "none"
    off_policy_correction_level: Literal["token", "sequence"] = "token"
    off_policy_correction_threshold: float = 2.0  # tis / mis only; at least 1
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: train adapters only (megatron engine)


@dataclass
class CriticConfig(TrainedRoleConfig):
    """Value model; used by estimators that need values (GAE)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # the base's, at a larger lr
    model_path: Optional[str] = None  # defaults to the actor's checkpoint
    cliprange_value: float = 0.5


@dataclass
class ReferenceConfig(LogProbConfig):
    """Frozen copy of the initial policy for KL; forward only."""

    enabled: bool = True
    # None: the actor's layout. The reference lives in the actor's processes,
    # which hold one megatron-core layout, so a value given must equal it.
    parallel: Optional[ParallelConfig] = None
    # "fsdp": the frozen model sharded over its processes (each holds 1/N of it): the actor's, whatever their
    # layout, or its own when placement.reference is apart; instead of a megatron-core copy at the actor's
    # layout. parallel is then not set. "adapters_off" (with actor.lora): the actor's own engine with its
    # adapters switched off, the base model; no reference model is built.
    engine: Literal["megatron", "fsdp", "adapters_off"] = "megatron"
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class SandboxConfig:
    """Limits for each program the `code` reward runs (`rewards/sandbox.py`, `rewards/code.py`).

    Every run has no network, a private tmpfs as its only writable place, a clean environment and no view
    of the repository, /etc or the home directory (bubblewrap namespaces). Where the kernel refuses the
    namespaces the reward refuses to start, naming the reason, unless `allow_unisolated` is true (then only
    the rlimits, the clean environment, the private directory and the process-group kill apply).
    """

    cpu_s: float = 2.0  # CPU seconds per program run (RLIMIT_CPU)
    wall_s: float = 4.0  # wall seconds per program run; the whole sandbox is killed past it
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    processes: int = 16  # processes and threads the program may have at once (RLIMIT_NPROC)
    file_size_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE); also its tmpfs' size
    output_kb: int = 256  # stdout+stderr kept per run; more is cut and the run fails
    # "fraction": the score is the share of the row's tests passed; "all": 1.0 only when every test passes.
    score: Literal["fraction", "all"] = "fraction"
    allow_unisolated: bool = False  # run without namespaces where the kernel refuses them (not safe)


@dataclass
class HttpRewardConfig:
    """`reward.kind: http`: batches POSTed to `url` as OpenRLHF's remote reward models take them,
    {"query": [prompt + response, ...], "prompts": [...], "labels": [...]}, answered {"rewards": [...]}
    (or "scores"), one number per query (`rewards/remote.py`)."""

    url: Optional[str] = None  # http:// or https://
    batch_size: int = 32  # queries per request
    max_in_flight: int = 4  # requests open at once
    retries: int = 3  # further tries of a request that failed or timed out
    backoff_s: float = 0.5  # wait before retry k is backoff_s * 2**k


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (`algos/overlong.py`): a response of L tokens, with L_max =
    data.max_response_length, scores 0 up to L_max - length, then down linearly to -penalty at L_max, added to
    its reward before the advantages (validation and `reward/accuracy` read the reward without it)."""

    length: int = 0  # the buffer's tokens before the limit; 0: off
    penalty: float = 1.0  # what a response of L_max tokens loses


@dataclass
class JudgeConfig:
    """`reward.kind: judge`: a generative model reads `template` (with {prompt}, {response} and {ground_truth})
    and the verdict in its answer is the score (`roles/judge.py`): for "yes_no" 1.0 when the answer's last
    yes/no word is yes and 0.0 when it is no; for "number" its last number divided by `scale`, clipped to
    [0, 1]. An answer with no verdict scores 0 and counts as a failed row (reward/failures)."""

    model_path: Optional[str] = None  # HF checkpoint, generated greedily by the built-in engine where rows are scored
    template: str = ("Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
                     "Is the response correct? Answer yes or no.\nVerdict:")
    verdict: Literal["yes_no", "number"] = "yes_no"
    scale: float = 1.0  # "number": the verdict is divided by this (10 for a 0-10 grade)
    max_new_tokens: int = 16
    batch_size: int = 8  # prompts per generate call
    stop: list[str] = field(default_factory=lambda: ["\n"])  # strings that end the judge's answer
    # Where the judge model runs (workers/judge.py): "rollout" in the rollout's worker, scoring the rows where
    # they are made; "reward" a worker group of its own on placement.reward's devices; "reference" in the
    # reference's processes (the actor's, or the reference's group apart). The scores are the same.
    placement: Literal["rollout", "reward", "reference"] = "rollout"


@dataclass
class RewardConfig:
    """Rule-based reward functions and an optional reward model."""

    # A registry name, or "path/to/file.py:function": that file is imported, top-level code included, like
    # any Python config hook; give only code you trust. Only env.function does the same.
    function: str = "default"
    model_path: Optional[str] = None  # HF sequence-classification checkpoint
    rule_weight: float = 1.0
    model_weight: float = 1.0
    micro_batch_size: int = 16
    # "hf": the whole classifier on every rank of placement.reward; "fsdp": sharded over those ranks by FSDP2
    # (engine/fsdp_frozen.py), each holding about 1/N of it.
    engine: Literal["hf", "fsdp"] = "hf"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO's length penalty
    # What scores each response (roles/scoring.py build_scorer): "function" (reward.function, row by row),
    # "http" (reward.http: batches POSTed to an endpoint), "judge" (reward.judge: a generative model's verdict).
    kind: Literal["function", "http", "judge"] = "function"
    # Seconds per reward call (one row) before it scores 0; for http, per request (then retried, reward.http).
    timeout_s: float = 30.0
    # Processes scoring rows in parallel; 0: in the scoring process, on a thread (a call past timeout_s is
    # abandoned there, not stopped). math and code always run in processes (2 when this is 0).
    workers: int = 0
    # A row whose reward raised, timed out or returned no number scores 0 and is counted (reward/failures);
    # more than this fraction of a batch failing stops the run, naming the reward and the first failing row.
    max_failure_fraction: float = 0.1
    # Score each chunk of a rollout (rollout.batch_size_per_device prompts) while the next one generates, in
    # the rollout's worker (roles/scoring.py RolloutScoring); the scores, counts and errors equal scoring the
    # whole batch after it. "auto": on for kinds function and http, off for judge (its model would generate
    # beside the rollout's); true or false to choose.
    async_scoring: Literal["auto", True, False] = "auto"
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # the code reward's limits
    http: HttpRewardConfig = field(default_factory=HttpRewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class EnvConfig:
    """Multi-turn rollouts against an environment (hybridflow/envs, rollout/agent.py); no function: single-turn.

    data.max_response_length bounds a whole trajectory (model turns, tool output and template glue).
    """

    # "calculator", "python", or "path/to/file.py:make_env" (a factory with no arguments; imported like
    # reward.function: give only code you trust).
    function: Optional[str] = None
    max_turns: int = 4  # model turns per trajectory
    max_turn_tokens: int = 128  # new tokens per model turn
    # Tokens that end a model turn besides EOS, e.g. ["</tool_call>"] where the vocabulary has it as one token.
    stop_tokens: list[str] = field(default_factory=list)


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (`trainer/dapo.py`): a step generates batches of data.train_batch_size prompts
    until it holds that many groups whose scores differ (a GRPO signal), or until it has generated max_batches
    batches (it then trains on the groups it holds and logs a warning). Extra groups of the last batch are
    left out. Needs rollout.n >= 2; the group filter reads the reward before reward.overlong_buffer, as the
    paper filters on accuracy."""

    enabled: bool = False
    max_batches: int = 10


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # name in the algorithms registry
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["k1", "k2", "k3", "low_var_kl", "abs", "mse"] = "k1"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    skip_uniform_groups: bool = False  # drop groups whose rewards are all equal
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    # DAPO's overlong filtering: a response cut by data.max_response_length (it used every token and did not end
    # on a stop token) contributes no loss; it still counts in its group's reward statistics.
    mask_truncated: bool = False


@dataclass
class PlacementConfig:
    """Device indices per role, as in docs/api.md; an empty list means every device.

    Roles may share devices (colocated, the hybrid layout) or not (split).
    """

    rollout: list[int] = field(default_factory=list)
    reward: list[int] = field(default_factory=list)
    training: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)
    critic: list[int] = field(default_factory=list)


@dataclass
class DataflowConfig:
    async_execution: bool = False
    min_batch_for_reward: int = 0  # 0: wait for the whole rollout batch


@dataclass
class TrainerConfig:
    project: str = "hybridflow"
    experiment: str = "run"
    output_dir: str = "runs"
    device: Literal["cpu", "cuda"] = "cpu"
    n_devices: int = 1  # processes (GPUs, or CPU ranks) in the job
    seed: int = 0
    total_steps: int = 100
    val_every: int = 10
    val_before_train: bool = True  # validate once before step 1 (the start of the accuracy curve)
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    resume: Literal["disable", "auto"] = "disable"  # auto: continue from the newest checkpoint in the run dir
    # A run directory that holds a previous run is refused unless resume=auto or overwrite=true (start over:
    # a new metrics file, and the old checkpoints are pruned as new ones are saved).
    overwrite: bool = False
    loggers: list[LoggerName] = field(default_factory=lambda: ["console", "jsonl"])
    # Draw plots/metrics.png from metrics.jsonl when the run ends (with the jsonl logger; ~0.4 s on CPU).
    # false: none (a sweep of many short runs); `hybridflow plot RUN_DIR` draws it later.
    plot: bool = True
    # A Ray cluster to join ("auto" or "host:port"), with its own auth and bind settings (SECURITY.md);
    # None starts a private local one: loopback only, token auth on.
    ray_address: Optional[str] = None
    # Where the worker groups run: "ray" (one Ray actor per device), "local"
    # (in this process; or this rank's share under torchrun), "auto" (Ray when
    # n_devices > 1 or ray_address is set, else local).
    launcher: Literal["auto", "ray", "local"] = "auto"
    # How a Ray run's token tensors and texts travel between worker groups: "object_store" (each worker leaves
    # them in Ray's object store; the driver passes references and one number a row) or "driver" (through
    # the driver, as verl's controller moves them). Both give the same numbers; `hybridflow bench data_plane`
    # measures the bytes and the step time of each.
    data_plane: Literal["object_store", "driver"] = "object_store"
    # Overlap of rollout and update, with the rollout placed apart (placement.rollout off placement.training):
    # "sync" (lock step), "one_step" (batch t+1 generates with the weights of before update t while update t
    # runs), "async" (the rollout group generates up to max_staleness versions ahead; weights are pushed to it
    # every sync_every updates). Every sample carries the weight version that generated it (dataflow/off_policy.py).
    off_policy: Literal["sync", "one_step", "async"] = "sync"
    max_staleness: int = 1  # async: updates a sample's weights may lag the trainer's when it trains on it
    # async: "wait" (the rollout waits for fresh enough weights) or "drop" (it never waits; a batch staler
    # than max_staleness when its step comes is dropped and generated again from the trainer's weights).
    stale_samples: Literal["wait", "drop"] = "wait"
    sync_every: int = 1  # async: push the actor's weights to the rollout group every this many updates


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    dataflow: DataflowConfig = field(default_factory=DataflowConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
