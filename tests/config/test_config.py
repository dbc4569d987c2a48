"""Typed config: YAML + overrides, errors that name the key path, cross-field rules."""
import inspect
import textwrap

import pytest

from hybridflow.config.loader import dump_config, load_config, to_dict
from hybridflow.config.schema import ActorConfig, Config, DataConfig
from hybridflow.config.validate import check_model_split
from hybridflow.errors import ConfigError
from hybridflow.parallel import ParallelDims

BASE = ["model.path=/models/tiny", "data.train_files=[a.parquet]"]


def _write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_yaml_and_overrides_build_typed_sections(tmp_path):
    path = _write(tmp_path, """
        model: {path: /models/tiny}
        data: {train_files: [a.parquet], max_prompt_length: 64}
        actor:
          optim: {lr: 1e-5}      # YAML 1.1 reads this as a string; the schema says float
          parallel: {tp: 2}
        rollout: {n: 4, tg: 2}
        algorithm: {adv_estimator: grpo}
        trainer: {n_devices: 4, experiment: exp}
    """)
    cfg = load_config(path, ["actor.optim.lr=3e-4", "trainer.experiment=007", "placement.rollout=[0, 1]"])
    assert isinstance(cfg, Config) and isinstance(cfg.actor, ActorConfig)
    assert cfg.actor.optim.lr == pytest.approx(3e-4) and isinstance(cfg.actor.optim.lr, float)
    assert cfg.trainer.experiment == "007"  # a string field keeps the raw text
    assert cfg.placement.rollout == [0, 1]
    assert cfg.data.train_files == ["a.parquet"] and cfg.data.max_prompt_length == 64
    assert cfg.critic.optim.lr == pytest.approx(1e-5)  # untouched defaults survive


def test_dump_and_reload_round_trip(tmp_path):
    cfg = load_config(None, BASE + ["rollout.n=8", "algorithm.adv_estimator=grpo"])
    dump_config(cfg, tmp_path / "out.yaml")
    assert to_dict(load_config(tmp_path / "out.yaml")) == to_dict(cfg)


@pytest.mark.parametrize("overrides, path, hint", [
    (["actor.optim.lrr=1"], "actor.optim.lrr", "did you mean 'lr'?"),
    (["rollot.n=2"], "rollot", "did you mean 'rollout'?"),
    (["trainer.total_step=3"], "trainer.total_step", "did you mean 'total_steps'?"),
    (["actor.ppo_epochs=true"], "actor.ppo_epochs", "expected int"),
    (["rollout.temperature=hot"], "rollout.temperature", "expected float"),
    (["rollout.engine=vlm"], "rollout.engine", "did you mean 'vllm'?"),
    (["reward.engine=fsdpp"], "reward.engine", "did you mean 'fsdp'?"),
    (["placement.rollout=[0, x]"], "placement.rollout[1]", "expected int"),
    (["actor.optim=3"], "actor.optim", "expected a mapping"),
    (["trainer.seed.x=3"], "trainer.seed", "is a value, not a section"),
])
def test_bad_keys_and_types_name_the_path(overrides, path, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + overrides)
    assert err.value.path == path
    assert hint in str(err.value) and str(err.value).startswith(path)


def test_unknown_key_in_yaml_file(tmp_path):
    path = _write(tmp_path, """
        model: {path: /m}
        actor:
          ppo_mini_batchsize: 4
    """)
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batchsize: unknown key \(did you mean 'ppo_mini_batch_size'\?\)"):
        load_config(path)


@pytest.mark.parametrize("key, value", [("log_prob_micro_batch_size", 1), ("log_prob_use_dynamic_bsz", True),
                                        ("log_prob_max_token_len_per_gpu", 1), ("log_prob_share_prompts", True)])
def test_the_old_log_prob_keys_under_rollout_point_to_the_actor_that_reads_them(tmp_path, key, value):
    """The old log-probs' micro-batching is the actor's pass: its keys left rollout for actor."""
    hint = rf"rollout.{key}: unknown key \(did you mean 'actor.{key}'\? it moved to the role that reads it\)"
    with pytest.raises(ConfigError, match=hint):
        load_config(None, BASE + [f"rollout.{key}={value}"])
    with pytest.raises(ConfigError, match=hint):
        load_config(_write(tmp_path, f"""
            model: {{path: /m}}
            rollout:
              {key}: {value}
        """))
    assert load_config(None, BASE + [f"actor.{key}={value}"]).actor == ActorConfig(**{key: value})


@pytest.mark.parametrize("overrides, path, fragment", [
    ([], "model.path", "is required"),
    (BASE + ["actor.parallel.tp=2"], "actor.parallel", "does not divide the 1 device"),
    (BASE + ["trainer.n_devices=8", "actor.parallel.tp=2", "actor.parallel.pp=3"], "actor.parallel",
     "2*3*1 = 6"),
    (BASE + ["trainer.n_devices=4", "actor.parallel.tp=4", "rollout.tg=3"], "rollout.tg", "must divide"),
    (BASE + ["trainer.n_devices=4", "actor.parallel.pp=2", "rollout.pg=4"], "rollout.pg", "must divide"),
    (BASE + ["trainer.n_devices=3", "placement.training=[0, 1]", "placement.reference=[0, 1]",
             "placement.rollout=[2]", "rollout.tg=2"], "rollout.tg", "must divide the rollout group's 1 devices"),
    (BASE + ["trainer.n_devices=4", "placement.reward=[4]"], "placement.reward", "do not exist"),
    (BASE + ["trainer.n_devices=4", "placement.training=[0, 0]"], "placement.training", "twice"),
    (BASE + ["trainer.n_devices=4", "placement.training=[0, 1, 2]", "actor.parallel.tp=2"],
     "actor.parallel", "3 device(s)"),
    (BASE + ["algorithm.adv_estimator=grpo", "rollout.n=1"], "rollout.n", "needs n >= 2"),
    (BASE + ["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"], "actor.ppo_mini_batch_size",
     "does not divide"),
    (BASE + ["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
    (BASE + ["actor.parallel.sequence_parallel=true"], "actor.parallel.sequence_parallel", "needs tp >= 2"),
    (BASE + ["trainer.n_devices=2", "actor.parallel.tp=2", "actor.parallel.sequence_parallel=true",
             "model.cpu_layer_kernels=false"], "model.cpu_layer_kernels", "must be true for actor.parallel"),
    (BASE + ["dataflow.min_batch_for_reward=1000"], "dataflow.min_batch_for_reward", "exceeds"),
    (BASE + ["data.skip_uniform_passes=-1"], "data.skip_uniform_passes", "must be >= 0 (0: no prompt skipped)"),
    (BASE + ["data.skip_uniform_min_score=.nan"], "data.skip_uniform_min_score", "finite number or null"),
    (BASE + ["algorithm.adv_estimator=gae", "data.skip_uniform_passes=2"], "data.skip_uniform_passes",
     "needs groups of samples (rollout.n >= 2)"),
    (BASE + ["trainer.n_devices=2", "reference.parallel.tp=2"], "reference.parallel.tp",
     "must equal actor.parallel.tp=1"),
    (BASE + ["algorithm.adv_estimator=remaxx"], "algorithm.adv_estimator", "nearest registered: 'remax'"),
    (BASE + ["actor.policy_loss=ppo2"], "actor.policy_loss", "unknown policy loss"),
    # Off-policy bounds (issue 40): named before any worker starts, whichever mode is set.
    (BASE + ["trainer.max_staleness=-1"], "trainer.max_staleness", "must be >= 0"),
    (BASE + ["trainer.off_policy=async", "trainer.sync_every=0"], "trainer.sync_every", "must be >= 1"),
    (BASE + ["trainer.off_policy=async", "trainer.max_staleness=1", "trainer.sync_every=3"], "trainer.sync_every",
     "use at most 2, or stale_samples=drop"),
    (BASE + ["trainer.off_policy=one_step", "algorithm.adv_estimator=grpo", "rollout.n=2",
             "data.skip_uniform_passes=1"], "data.skip_uniform_passes", "generating ahead"),
    (BASE + ["actor.off_policy_correction=tis", "actor.off_policy_correction_threshold=0.5"],
     "actor.off_policy_correction_threshold", "must be a finite number >= 1"),
])
def test_impossible_combinations_fail_early(overrides, path, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.path == path
    assert fragment in str(err.value)


def test_remax_is_accepted_and_plans_its_greedy_baseline():
    """ReMax needs no second sample (its baseline is the greedy response): rollout.n = 1 is accepted."""
    from hybridflow.config.plan import RunPlan

    cfg = load_config(None, BASE + ["algorithm.adv_estimator=remax", "rollout.n=1"])
    assert RunPlan.from_config(cfg).needs_greedy_baseline and not RunPlan.from_config(cfg).uses_critic
    assert not RunPlan.from_config(load_config(None, BASE + ["algorithm.adv_estimator=grpo", "rollout.n=2"])).needs_greedy_baseline


def test_valid_split_placement():
    cfg = load_config(None, BASE + [
        "trainer.n_devices=4", "placement.rollout=[0, 1]", "placement.reward=[2]",
        "placement.training=[0, 1, 2, 3]", "actor.parallel.tp=2", "rollout.tg=1"])
    assert cfg.placement.reward == [2]
    # A rollout group apart generates at its own tg, whatever the actor's tp (here 1).
    apart = load_config(None, BASE + ["trainer.n_devices=4", "placement.training=[0, 1]",
                                      "placement.reference=[0, 1]", "placement.rollout=[2, 3]", "rollout.tg=2"])
    assert apart.rollout.tg == 2 and apart.actor.parallel.tp == 1


def test_missing_or_malformed_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none.yaml")):
        load_config(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["model.path"])


def test_components_take_only_their_section():
    """rule 5, docs/conventions.md: each component's constructor receives its own section, never Config."""
    from hybridflow.data import PromptDataset

    params = list(inspect.signature(PromptDataset).parameters.values())
    assert params[0].annotation in (DataConfig, "DataConfig")


def test_roles_and_workers_never_receive_the_whole_config():
    """Workers get a spec of the sections they use (workers/specs.py); roles get their own section."""
    from hybridflow.config.schema import Config
    from hybridflow.roles import Actor, Critic, Reference, Rollout
    from hybridflow.workers import rl_workers

    classes = [Actor, Critic, Reference, Rollout, rl_workers.ActorRolloutRefWorker, rl_workers.RolloutWorker,
               rl_workers.CriticWorker, rl_workers.RewardModelWorker]
    for cls in classes:
        for param in inspect.signature(cls).parameters.values():
            assert param.annotation not in (Config, "Config"), f"{cls.__name__}({param.name}: Config)"


def _model(**overrides):
    from hybridflow.models import DecoderConfig

    shape = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=16)
    return DecoderConfig(**{**shape, **overrides})


@pytest.mark.parametrize("overrides, path, fragment", [
    # 2 prompts x n=1 responses cannot split over 4 data-parallel replicas
    (["trainer.n_devices=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2"],
     "actor.ppo_mini_batch_size", "do not split over the actor's 4 data-parallel replicas"),
    (["trainer.n_devices=4", "actor.parallel.tp=4"], "actor.parallel.tp", "does not divide the model's 2 KV heads"),
    # An off-policy mode overlaps a rollout group apart: none colocated, none without Ray.
    (["trainer.off_policy=one_step"], "trainer.off_policy", "this run has none"),
    (["trainer.off_policy=async", "trainer.n_devices=2", "trainer.launcher=ray"], "trainer.off_policy",
     "placement.rollout devices other than placement.training's"),
])
def test_checks_that_need_the_model_or_the_launcher(overrides, path, fragment):
    from hybridflow.config.plan import RunPlan
    from hybridflow.config.preflight import check_runnable

    cfg = load_config(None, BASE + overrides)
    with pytest.raises(ConfigError) as err:
        check_runnable(cfg, RunPlan.from_config(cfg), _model())
    assert err.value.path == path and fragment in str(err.value)


def test_the_critic_layout_is_checked_against_the_critics_own_model():
    from hybridflow.config.plan import RunPlan
    from hybridflow.config.preflight import check_runnable

    cfg = load_config(None, BASE + ["algorithm.adv_estimator=gae", "trainer.n_devices=2", "critic.parallel.tp=2",
                                    "data.train_batch_size=4", "actor.ppo_mini_batch_size=2"])
    check_runnable(cfg, RunPlan.from_config(cfg), _model())  # the actor's model splits 2 ways
    with pytest.raises(ConfigError, match="critic.parallel.tp: 2 does not divide the model's 3 attention heads"):
        check_runnable(cfg, RunPlan.from_config(cfg), _model(), critic_model=_model(num_heads=3, num_kv_heads=1))
    with pytest.raises(ConfigError, match="critic.parallel.tp: 2 does not divide the model's 95 MLP features"):
        check_runnable(cfg, RunPlan.from_config(cfg), _model(), critic_model=_model(intermediate_size=95))


def test_under_torchrun_layouts_follow_the_processes_and_the_critic_shares_the_actors(monkeypatch):
    """torchrun sets WORLD_SIZE: layouts are checked against it, not trainer.n_devices; and without Ray the
    critic lives in the actor's processes, which hold one megatron-core layout."""
    from hybridflow.config.plan import RunPlan
    from hybridflow.config.preflight import check_runnable

    monkeypatch.setenv("WORLD_SIZE", "2")
    load_config(None, BASE + ["actor.parallel.tp=2"])  # 2 processes, though trainer.n_devices is 1
    cfg = load_config(None, BASE + ["algorithm.adv_estimator=gae", "critic.parallel.tp=2"])
    with pytest.raises(ConfigError, match="critic.parallel.tp: must equal actor.parallel.tp=1 without Ray"):
        check_runnable(cfg, RunPlan.from_config(cfg), _model())
    with pytest.raises(ConfigError, match="dataflow.async_execution: needs trainer.launcher=ray"):
        cfg = load_config(None, BASE + ["dataflow.async_execution=true"])
        check_runnable(cfg, RunPlan.from_config(cfg), _model())
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = load_config(None, BASE + ["dataflow.async_execution=true"])
    check_runnable(cfg, RunPlan.from_config(cfg), _model())  # one process: fine


@pytest.mark.parametrize("dims, model, key", [
    (ParallelDims(tp=3), dict(num_heads=4, num_kv_heads=2, num_layers=2), "actor.parallel.tp"),
    (ParallelDims(tp=4), dict(num_heads=8, num_kv_heads=2, num_layers=2), "actor.parallel.tp"),
    (ParallelDims(pp=3), dict(num_heads=4, num_kv_heads=2, num_layers=4), "actor.parallel.pp"),
])
def test_model_split_names_the_key(dims, model, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_model_split(dims, "actor.parallel", **model)


def test_model_split_virtual_pipeline():
    check_model_split(ParallelDims(pp=2), "actor.parallel", num_heads=4, num_kv_heads=2, num_layers=4, virtual_pp=2)
    with pytest.raises(ConfigError, match=r"pp\*virtual_pp = 2\*3 does not divide the model's 4 layers"):
        check_model_split(ParallelDims(pp=2), "actor.parallel", num_heads=4, num_kv_heads=2, num_layers=4, virtual_pp=3)
