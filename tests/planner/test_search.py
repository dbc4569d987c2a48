"""`hybridflow plan`: the ranked table, the misfits' reasons, the written config, the scenario, bad input."""
import dataclasses
from pathlib import Path

import pytest

from hybridflow.config.loader import load_config
from hybridflow.config.plan import RunPlan
from hybridflow.config.validate import check_model_split
from hybridflow.errors import ConfigError
from hybridflow.parallel.layout import ParallelDims
from hybridflow.planner import cli, roles
from hybridflow.planner.devices import get_device
from hybridflow.planner.roles import Workload
from hybridflow.planner.search import Planner, gpus_needed, rank
from tests.planner.test_cost import QWEN7B

CONFIG_7B = "configs/qwen2.5-7b-ppo-gsm8k.yaml"


def test_the_best_7b_plan_on_16_a100s_is_written_as_a_config_that_loads(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert cli.main([CONFIG_7B, "--gpus", "16", "--device", "a100", "--out", str(out), "--top", "3",
                     "--prompts-per-day", "1e6"]) == 0
    text = capsys.readouterr().out
    assert "candidates fit" in text and "bottleneck" in text and "transition bytes per rank: exact" in text
    assert "scenario: 1,000,000 prompts/day on 16 devices" in text
    cfg = load_config(out)  # as `hybridflow train` reads it: every config check passes
    header = out.read_text().splitlines()[1]  # "# best candidate: colocated [all16] actor p2-t2-d4 tg2 ..."
    assert f"actor p{cfg.actor.parallel.pp}-t{cfg.actor.parallel.tp}-" in header and f"tg{cfg.rollout.tg}" in header
    assert cfg.trainer.n_devices == 16 and cfg.trainer.device == "cuda" and cfg.rollout.tg in (1, 2, 4, 8)
    assert cfg.data.train_batch_size == 1024 and cfg.model.path == "models/Qwen2.5-7B-Instruct"  # the base kept
    plan = RunPlan.from_config(cfg)
    for role in ("training", "critic"):
        check_model_split(plan.layouts[role], role, num_heads=28, num_kv_heads=4, num_layers=28,
                          mlp_splits=(("MLP features", 18944),))
    assert cfg.data.train_batch_size % plan.prompt_multiple == 0
    assert plan.mini_batch_responses % plan.layouts["training"].dp == 0
    assert not list(tmp_path.glob(".plan.yaml.*"))  # the temporary file was renamed into place


def test_a_70b_job_on_64_h100s_dry_runs_with_exact_bytes(capsys):
    assert cli.main(["configs/llama3-70b-ppo-gsm8k.yaml", "--gpus", "64", "--device", "h100", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "70.55 B parameters" in text and "plan_reshard over" in text and "(diff +0)" in text


def test_misfits_name_the_role_and_the_gib_over():
    cfg = load_config(CONFIG_7B, ["trainer.n_devices=16"])
    small = dataclasses.replace(get_device("a100"), memory_bytes=24 * 1024 ** 3)
    fits, misfits = rank(Planner(QWEN7B, Workload.from_config(cfg), small).candidates(8))
    assert not fits and misfits
    assert all(" GiB over" in c.reason and ("update" in c.reason or "rollout" in c.reason or "passes" in c.reason)
               for c in misfits)
    # Every colocated candidate holds actor, critic and reference: the 7B states alone overflow 24 GiB at d1.
    c = Planner(QWEN7B, Workload.from_config(cfg), small).colocated(8, ParallelDims(1, 1, 8), ParallelDims(1, 1, 8), 1)
    assert c.reason.startswith("all devices, ") and float(c.reason.split(": ")[1].split()[0]) > 10
    assert "[actor " in c.reason and "critic " in c.reason and "reference " in c.reason
    # Split apart, the actor's devices list only the roles they hold.
    c = Planner(QWEN7B, Workload.from_config(cfg), small).split(
        "split-critic", {"actor": 4, "critic": 4}, ParallelDims(tp=1, pp=1, dp=4), ParallelDims(tp=1, pp=1, dp=4), 1)
    assert c.reason.startswith("actor devices, ") and "critic" not in c.reason.split("[")[1]


def test_more_memory_or_devices_never_makes_the_best_plan_slower():
    cfg = load_config(CONFIG_7B, ["trainer.n_devices=16"])
    wl = Workload.from_config(cfg)
    a100, h200 = get_device("a100"), get_device("h200")
    best = {n: rank(Planner(QWEN7B, wl, a100).candidates(n))[0][0].iteration_s for n in (8, 16)}
    assert best[16] < best[8]
    assert rank(Planner(QWEN7B, wl, h200).candidates(16))[0][0].iteration_s < best[16]


def test_the_scenario_finds_how_many_devices_reach_a_target(capsys):
    cfg = load_config(CONFIG_7B, ["trainer.n_devices=16"])
    planner = Planner(QWEN7B, Workload.from_config(cfg), get_device("a100"))
    enough = gpus_needed(planner, 17, 3e6)
    assert enough is not None and enough.prompts_per_day(1024) >= 3e6 and sum(enough.devices.values()) > 16
    assert cli.main([CONFIG_7B, "--gpus", "16", "--prompts-per-day", "3e6", "--no-dry-run", "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "NOT reachable" in text and f"reachable with {sum(enough.devices.values())} devices" in text


def test_bad_input_is_one_error_naming_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        cli.main([str(tmp_path / "missing.yaml"), "--gpus", "8"])
    with pytest.raises(ConfigError, match="--device: unknown device 'b200'"):
        cli.main([CONFIG_7B, "--gpus", "8", "--device", "b200"])
    with pytest.raises(ConfigError, match="model.path: no config.json in 'models/Mystery-9B'"):
        cli.main([CONFIG_7B, "model.path=models/Mystery-9B", "--gpus", "8"])
    with pytest.raises(ConfigError, match="--placements: unknown"):
        cli.main([CONFIG_7B, "--gpus", "8", "--placements", "colocated,everywhere"])
    with pytest.raises(ConfigError, match="actor.parallel.tpp: unknown key"):
        cli.main([CONFIG_7B, "actor.parallel.tpp=2", "--gpus", "8"])


def test_split_placements_are_written_as_configs_that_load(tmp_path):
    """The best split-critic and split-all candidates, written like the best one: device blocks per role."""
    from hybridflow.config.loader import _read_yaml
    from hybridflow.planner import report

    base = _read_yaml(Path(CONFIG_7B))
    cfg = load_config(CONFIG_7B, ["trainer.n_devices=16"])
    fits, _ = rank(Planner(QWEN7B, Workload.from_config(cfg), get_device("a100")).candidates(16))
    for placement in ("split-critic", "split-all"):
        best = next(c for c in fits if c.placement == placement)
        out = tmp_path / f"{placement}.yaml"
        report.write_overlay(out, report.overlay_data(best, base, True, "a100"), ["test"])
        plan = RunPlan.from_config(load_config(out))
        assert plan.rollout_apart == (placement == "split-all")
        assert plan.layouts["training"].world_size == best.devices["actor"]
        assert plan.layouts["critic"].world_size == best.devices["critic"]
        assert set(plan.devices["critic"]).isdisjoint(plan.devices["training"])


def test_a_reward_model_is_costed_where_it_is_placed(capsys):
    """reward.model_path: its forward pass and weights join the critic's devices (or every device)."""
    assert cli.main([CONFIG_7B, "reward.model_path=models/Qwen2.5-0.5B-Instruct", "--gpus", "16", "--top", "1",
                     "--no-dry-run"]) == 0
    text = capsys.readouterr().out
    assert "reward model True" in text and "reward_model" in text.split("best:")[1]
    cfg = load_config(CONFIG_7B, ["trainer.n_devices=16"])
    rm = cli.resolve_model("models/Qwen2.5-0.5B-Instruct", "reward.model_path")
    planner = Planner(QWEN7B, Workload.from_config(cfg, reward_model=rm), get_device("a100"))
    layouts = {"actor": ParallelDims(tp=2, pp=1, dp=4), "critic": ParallelDims(tp=1, pp=1, dp=8), "tg": 2}
    split = planner.split("split-critic", {"actor": 8, "critic": 8}, *layouts.values())
    without = Planner(QWEN7B, Workload.from_config(cfg), get_device("a100")).split(
        "split-critic", {"actor": 8, "critic": 8}, *layouts.values())
    assert split.device_peak["critic"] > without.device_peak["critic"]
    assert split.device_peak["actor"] == without.device_peak["actor"]


def test_a_long_context_job_is_planned_with_context_parallelism(tmp_path, capsys):
    """Qwen2.5-0.5B with 16k-token responses on 8 H100s: no tp/pp layout fits the update's activations (the
    unfused attention's probabilities grow with S^2), layouts with cp > 1 do; the best plan is written with its cp
    and loads as `hybridflow train` reads it. With packed rows no cp layout is offered (the engine runs
    them at cp = 1)."""
    long = ["data.max_response_length=16384", "actor.log_prob_micro_batch_size=1", "actor.ppo_micro_batch_size=1"]
    out = tmp_path / "long.yaml"
    assert cli.main(["configs/qwen2.5-0.5b-grpo-gsm8k.yaml", *long, "--gpus", "8", "--device", "h100",
                     "--out", str(out), "--no-dry-run"]) == 0
    text = capsys.readouterr().out
    assert "p2-t2-d2 tg1: all devices, actor update:" in text  # a tp x pp layout does not fit
    cfg = load_config(out)
    assert cfg.actor.parallel.cp > 1
    assert RunPlan.from_config(cfg).layouts["training"].cp == cfg.actor.parallel.cp
    packed = cli.main(["configs/qwen2.5-0.5b-grpo-gsm8k.yaml", *long, "actor.use_dynamic_bsz=true", "--gpus", "8",
                       "--device", "h100", "--no-dry-run"])
    text = capsys.readouterr().out
    assert "-c2" not in text and "-c4" not in text and "-c8" not in text, text
    assert packed == 1 or "0 candidates fit" in text


def test_the_interleaved_pipeline_is_offered_costed_and_written(tmp_path):
    """GRPO on Qwen2.5-0.5B (24 layers, no critic): each pp > 1 layout is also costed at virtual_pp 2 and 4
    (the layers split into pp x v chunks); at the same layout the interleaved update is faster (a v times
    smaller bubble) and holds more activations; a v2 candidate is written as a config that loads with
    actor.parallel.virtual_pp 2. Offered at cp > 1 and with the rollout apart (split-all) too; not with a
    critic (its layout is not paired with the actor's)."""
    from hybridflow.config.loader import _read_yaml
    from hybridflow.planner import report

    config = "configs/qwen2.5-0.5b-grpo-gsm8k.yaml"
    cfg = load_config(config, ["trainer.n_devices=8"])
    model = cli.resolve_model(cfg.model.path, "model.path")
    planner = Planner(model, Workload.from_config(cfg), get_device("h100"))
    found = planner.candidates(8, ("colocated",))
    labels = {c.label() for c in found}
    assert any("-v2 " in label for label in labels) and any("-v4 " in label for label in labels), labels
    assert all(c.actor.pp > 1 for c in found if c.virtual_pp > 1)
    # with context parallelism, and fed to a rollout apart (the trainer runs both): offered there too
    assert any(c.virtual_pp > 1 and c.actor.cp > 1 for c in found), labels
    apart = planner.candidates(8, ("split-all",))
    assert any(c.virtual_pp > 1 for c in apart) and any(c.actor.cp > 1 for c in apart)
    layout = ParallelDims(tp=1, pp=2, dp=4)
    one, two = (planner.colocated(8, layout, None, 1, v) for v in (1, 2))
    assert one.fits and two.fits
    assert two.stages["actor_update"]["compute"] < one.stages["actor_update"]["compute"]
    micro = min(one.micro["actor"], two.micro["actor"])  # the search halves a micro-batch until it fits
    assert roles.train_memory(model, planner.wl, layout, micro, vpp=2)["activations"] > \
        roles.train_memory(model, planner.wl, layout, micro)["activations"]
    out = tmp_path / "vpp.yaml"
    report.write_overlay(out, report.overlay_data(two, _read_yaml(Path(config)), False, "h100"), ["test"])
    written = load_config(out)
    assert written.actor.parallel.virtual_pp == 2 and written.actor.parallel.pp == 2
    ppo = load_config(CONFIG_7B, ["trainer.n_devices=16"])
    assert all(c.virtual_pp == 1 for c in Planner(QWEN7B, Workload.from_config(ppo), get_device("a100"))
               .candidates(16, ("colocated",)))
