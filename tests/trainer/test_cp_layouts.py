"""The layouts of issue 41 through the trainer on Ray (item 5): CP with TP and with PP (GRPO and PPO), TP with
sequence parallelism, the interleaved pipeline, each against one process (run once per config and module)."""
import json

import pytest
import torch

from hybridflow.cli import main
from hybridflow.models.checkpoint import load_hf_state_dict
from tests.trainer.test_distributed_trainer import ROOT, compare_with_one_process, run

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(400)]
GRPO_STEPS = ["trainer.total_steps=2", "trainer.val_every=0", "actor.ppo_mini_batch_size=8"]


@pytest.fixture(scope="module")
def one_process_grpo(tmp_path_factory):
    """tiny-grpo.yaml's two steps on one process, one mini-batch a step: what the GRPO layouts compare with."""
    return run("tiny-grpo.yaml", tmp_path_factory.mktemp("one"), "trainer.save_every=0", *GRPO_STEPS)[1]


def test_grpo_at_tp2_cp2_on_four_ray_workers_matches_the_single_process_run(tmp_path, one_process_grpo):
    """The actor at TP2 x CP2 on four Ray processes (one DP replica): each TP pair of a CP index gathers its
    generation weights itself (the 3D-HybridEngine's plan counts every CP rank as one more generation
    replica, so 4 replicas at tg = 1), each CP rank runs its load-balanced chunks through TP2 layers. Two
    steps' learned metrics equal one process's up to summation order. Its checkpoint (written by the CP
    rank 0 of each TP rank: CP ranks hold the same weights) converts with `hybridflow reshard` to the HF
    model the run exported, bit for bit."""
    summary, records = run("tiny-grpo.yaml", tmp_path / "tp2cp2", "trainer.n_devices=4", "trainer.launcher=ray",
                           "actor.parallel.tp=2", "actor.parallel.cp=2", "trainer.save_every=2", *GRPO_STEPS)
    compare_with_one_process("grpo at tp2 cp2", records, one_process_grpo)

    run_dir = summary["run_dir"]
    assert main(["reshard", str(run_dir / "checkpoints" / "step_000002"), str(tmp_path / "hf"), "--to", "hf",
                 "--config", str(ROOT / "hybridflow/assets/demo_model"), "--no-progress"]) == 0
    converted, exported = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(run_dir / "hf_actor")
    assert sorted(converted) == sorted(exported)
    assert all(torch.equal(converted[k], exported[k]) for k in exported)


def test_grpo_at_pp2_cp2_on_four_ray_workers_matches_the_single_process_run(tmp_path, one_process_grpo):
    """The actor at PP2 x CP2: megatron-core's 1F1B schedule sends each CP rank's chunks' activations from
    the first stage to the second (the schedule sizes them width / cp), the last stage gathers the output
    over the CP group; the reshard plan gathers the stages per CP index. Two steps equal one process."""
    _, records = run("tiny-grpo.yaml", tmp_path / "pp2cp2", "trainer.n_devices=4", "trainer.launcher=ray",
                     "actor.parallel.pp=2", "actor.parallel.cp=2", "trainer.save_every=0", *GRPO_STEPS)
    compare_with_one_process("grpo at pp2 cp2", records, one_process_grpo)


@pytest.fixture(scope="module")
def one_process_ppo(tmp_path_factory):
    """tiny-ppo.yaml's three steps on one process, one mini-batch a step: what the PPO layouts compare with."""
    return run("tiny-ppo.yaml", tmp_path_factory.mktemp("one"), *PPO_STEPS)[1]


PPO_STEPS = ["trainer.total_steps=3", "trainer.val_every=0", "trainer.save_every=0", "actor.ppo_mini_batch_size=8"]


def critic_too(overrides: list[str]) -> list[str]:
    """`overrides` with each `actor.parallel.*` one repeated for the critic: the critic at the actor's layout,
    in the actor's processes (a process holds one megatron-core layout; `RunPlan.colocate_critic`)."""
    return [*overrides, *(o.replace("actor.parallel.", "critic.parallel.", 1) for o in overrides
                          if o.startswith("actor.parallel."))]


def critic_at_the_actors_layout(trainer) -> None:
    """`run(..., before_fit=...)`: a PPO run's critic is at the actor's layout, in the actor's processes."""
    plan = trainer.plan
    if plan.uses_critic:
        assert plan.colocate_critic and plan.layouts["critic"] == plan.layouts["training"], plan.layouts


LLAMA_PPO_LAYOUTS = {"cp2": ["trainer.n_devices=2", "actor.parallel.cp=2"],
                     "tp2cp2": ["trainer.n_devices=4", "actor.parallel.tp=2", "actor.parallel.cp=2"],
                     "pp2cp2": ["trainer.n_devices=4", "actor.parallel.pp=2", "actor.parallel.cp=2"],
                     "tp2sp-dp2": ["trainer.n_devices=4", "actor.parallel.tp=2",
                                   "actor.parallel.sequence_parallel=true"],
                     "pp2vpp2-dp2": ["trainer.n_devices=4", "actor.parallel.pp=2", "actor.parallel.virtual_pp=2"]}


@pytest.mark.parametrize("layout", list(LLAMA_PPO_LAYOUTS))
def test_ppo_at_each_new_layout_on_ray_workers_matches_the_single_process_run(tmp_path, one_process_ppo, layout):
    """PPO (critic with GAE, reference with KL in the reward and as a loss) on the demo (Llama-shaped) model
    with the actor at CP2, TP2 x CP2, PP2 x CP2 (one DP replica), TP2 with sequence parallelism x DP2 and PP2
    with virtual_pp 2 x DP2, on two or four Ray processes, the critic at the same layout in the same
    processes (its values gathered over the CP group like the actor's log-probs) and the reference following
    it: three steps' learned metrics (the actor's, the critic's, the KL) equal one process's within 1e-5
    relative. (GRPO runs on this model at TP2 x CP2, PP2 x CP2, TP2 with sequence parallelism and PP2 x
    virtual_pp 2 in this file, at CP2 in test_distributed_trainer.py's rollout-apart case.)"""
    _, records = run("tiny-ppo.yaml", tmp_path / "layout", "trainer.launcher=ray",
                     *critic_too(LLAMA_PPO_LAYOUTS[layout]), *PPO_STEPS, before_fit=critic_at_the_actors_layout)
    compare_with_one_process(f"ppo at {layout}", records, one_process_ppo, steps=(1, 2, 3), rel=1e-5,
                             abs_=1e-6)


def test_grpo_at_tp2_with_sequence_parallelism_matches_the_single_process_run(tmp_path, one_process_grpo):
    """Sequence parallelism at TP2 on two Ray processes (issue 41, item 3, through the trainer): the
    activations between the TP regions are split over the sequence (reduce-scatter / all-gather pairs under
    gloo); the 3D-HybridEngine gathers the generation weights as at TP2. Two steps equal one process."""
    _, records = run("tiny-grpo.yaml", tmp_path / "sp", "trainer.n_devices=2", "trainer.launcher=ray",
                     "actor.parallel.tp=2", "actor.parallel.sequence_parallel=true", "trainer.save_every=0",
                     *GRPO_STEPS)
    compare_with_one_process("grpo at tp2 with sequence parallelism", records, one_process_grpo)


def test_grpo_at_pp2_virtual_pp2_on_two_ray_workers_matches_one_process_converts_and_resumes(tmp_path):
    """The interleaved pipeline (issue 41, item 4) through the trainer: the demo model's 4 layers in 2
    stages of 2 model chunks (stage 0 holds layers 0 and 2, stage 1 layers 1 and 3), megatron-core's
    interleaved schedule for the log-probs and the update, the 3D-HybridEngine gathering both chunks of each
    stage into the generation model. Three steps' learned metrics equal one process's within 1e-5
    (relative); the step-3 checkpoint (shards naming each chunk's tensors) converts with `hybridflow
    reshard` to the HF model the run exported, bit for bit; resumed from the step-2 checkpoint, step 3
    is the same step again."""
    import shutil

    from tests.trainer.test_trainer import learned

    common = ["trainer.total_steps=3", "trainer.val_every=0", "actor.ppo_mini_batch_size=8"]
    layout = ["trainer.n_devices=2", "trainer.launcher=ray", "actor.parallel.pp=2", "actor.parallel.virtual_pp=2"]
    summary, records = run("tiny-grpo.yaml", tmp_path / "vpp", *layout, "trainer.save_every=1", *common)
    _, single = run("tiny-grpo.yaml", tmp_path / "one", "trainer.save_every=0", *common)
    compare_with_one_process("grpo at pp2 virtual_pp2", records, single, steps=(1, 2, 3), rel=1e-5, abs_=1e-6)

    run_dir = summary["run_dir"]
    step3 = run_dir / "checkpoints" / "step_000003"
    assert json.loads((step3 / "trainer.json").read_text())["layouts"]["actor"] == "p2-t1-d1-v2"
    shard = torch.load(step3 / "actor" / "engine_tp0_pp1_dp0.pt", weights_only=True)["model"]
    assert "chunk1.decoder.layers.0.mlp.linear_fc1.weight" in shard  # global layer 3, the last chunk's
    assert main(["reshard", str(step3), str(tmp_path / "hf"), "--to", "hf",
                 "--config", str(ROOT / "hybridflow/assets/demo_model"), "--no-progress"]) == 0
    converted, exported = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(run_dir / "hf_actor")
    assert sorted(converted) == sorted(exported)
    assert all(torch.equal(converted[k], exported[k]) for k in exported)

    shutil.copytree(tmp_path / "vpp", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "tiny-grpo" / "checkpoints" / "step_000003")
    _, again = run("tiny-grpo.yaml", tmp_path / "resumed", *layout, "trainer.save_every=0", *common,
                   "trainer.resume=auto")
    assert [r["step"] for r in again] == [r["step"] for r in records]
    for key, value in learned(records)[3].items():
        assert learned(again)[3][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def _qwen2_shaped_model(path):
    """A Qwen2-shaped variant of the demo model at `path`: QKV bias, grouped-query attention (4 heads over 2
    KV heads) and a sliding window of 8 positions in every layer (`max_window_layers` 0; rows are up to 22
    tokens, so the window cuts; megatron-core's layer spec takes one window for all layers), random
    weights, the demo model's tokenizer."""
    import shutil

    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.checkpoint import save_hf_checkpoint
    from hybridflow.models.config import DecoderConfig
    from hybridflow.models.decoder import Decoder

    demo = ROOT / "hybridflow/assets/demo_model"
    hf = {**json.loads((demo / "config.json").read_text()), "model_type": "qwen2",
          "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 2, "attention_bias": True,
          "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
    cfg = DecoderConfig.from_hf_dict(hf)
    assert cfg.layer_windows == [8, 8, 8, 8] and cfg.qkv_bias
    decoder = Decoder(cfg).init_weights(std=0.2, seed=3)
    save_hf_checkpoint(get_bridge(cfg).generation_to_hf(dict(decoder.state_dict())), cfg.to_hf_dict(), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    return path


@pytest.fixture(scope="module")
def qwen2_shaped(tmp_path_factory):
    """The Qwen2-shaped model's path, and its three steps of a config on one process (what its layouts compare
    with), run once per config."""
    path, runs = _qwen2_shaped_model(tmp_path_factory.mktemp("qwen2")), {}

    def one_process(name: str) -> list[dict]:
        if name not in runs:
            runs[name] = run(name, tmp_path_factory.mktemp("one"), *_qwen2_steps(path))[1]
        return runs[name]

    return path, one_process


def _qwen2_steps(path) -> list[str]:
    return [f"model.path={path}", "trainer.total_steps=3", "trainer.val_every=0", "trainer.save_every=0",
            "actor.ppo_mini_batch_size=8"]


QWEN2_LAYOUTS = {"cp2": ["trainer.n_devices=2", "actor.parallel.cp=2"],
                 "tp2cp2": ["trainer.n_devices=4", "actor.parallel.tp=2", "actor.parallel.cp=2"],
                 "pp2cp2": ["trainer.n_devices=4", "actor.parallel.pp=2", "actor.parallel.cp=2"],
                 "tp2sp": ["trainer.n_devices=2", "actor.parallel.tp=2", "actor.parallel.sequence_parallel=true"],
                 "pp2vpp2": ["trainer.n_devices=2", "actor.parallel.pp=2", "actor.parallel.virtual_pp=2"],
                 "pp2vpp2cp2": ["trainer.n_devices=4", "actor.parallel.pp=2", "actor.parallel.virtual_pp=2",
                                "actor.parallel.cp=2"]}


@pytest.mark.parametrize("name,layout", [*(("tiny-grpo.yaml", k) for k in QWEN2_LAYOUTS if k != "pp2vpp2cp2"),
                                         *(("tiny-ppo.yaml", k) for k in QWEN2_LAYOUTS)])
def test_ppo_and_grpo_on_a_qwen2_shaped_model_with_a_sliding_window_at_each_new_layout_match_one_process(
        tmp_path, qwen2_shaped, name, layout):
    """Item 5's Qwen2-shaped, sliding-window case through the trainer: PPO at every new layout, with the
    critic (the same decoder with a value head) at the actor's layout in the actor's processes and the
    reference following it; GRPO at each of item 5's five (cp2, tp2cp2, pp2cp2, tp2sp, pp2vpp2). CP ranks' load-
    balanced chunks attend by global position within the window, TP splits the GQA heads and QKV bias, the
    window holds under sequence parallelism and in each interleaved chunk. Three steps' learned metrics equal
    one process's within 1e-5 (relative; 1e-6 absolute for PPO's small pg_loss). At cp2 both ranks of the
    one DP replica run their chunks of each padded row and generate the replica's (keyed) responses. The
    model's output layer is untied and applied in the loss (fused output) to the gathered hidden states on
    every CP rank, so actor/grad_norm checks that its gradient is not counted cp times (Adam alone would
    hide it: its update does not change when one weight's gradient doubles every step)."""
    path, one_process = qwen2_shaped
    _, records = run(name, tmp_path / "layout", "trainer.launcher=ray", *critic_too(QWEN2_LAYOUTS[layout]),
                     *_qwen2_steps(path), before_fit=critic_at_the_actors_layout)
    compare_with_one_process(f"{name} on the qwen2-shaped sliding window at {layout}", records,
                             one_process(name), steps=(1, 2, 3), rel=1e-5, abs_=1e-6)


def test_a_model_mixing_attention_windows_is_refused_for_megatron_before_any_worker_starts(tmp_path):
    """Qwen2's max_window_layers gives full attention below it and a window above; megatron-core's layer spec
    takes one window for all layers: a ConfigError naming model.path (it was a NotImplementedError in a
    worker's __init__)."""
    from hybridflow.config.loader import load_config
    from hybridflow.config.plan import RunPlan
    from hybridflow.config.validate import check_plan
    from hybridflow.errors import ConfigError
    from hybridflow.models.config import DecoderConfig
    from tests.trainer.test_trainer import in_repo

    path = _qwen2_shaped_model(tmp_path / "qwen2")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_window_layers": 2}))
    cfg = in_repo(load_config(ROOT / "configs/tiny-grpo.yaml", [f"trainer.output_dir={tmp_path}",
                                                                f"model.path={path}"]))
    with pytest.raises(ConfigError, match="model.path: its layers mix attention windows"):
        check_plan(cfg, RunPlan.from_config(cfg), DecoderConfig.from_pretrained(path))
