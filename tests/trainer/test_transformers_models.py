"""A model hybridflow's decoder does not build (GPT-2: learned positions, LayerNorm, GELU, Conv1D layers, tied
embeddings) trained through the trainer, every role on `transformers` (`<role>.engine: fsdp`,
`<role>.fsdp.modeling: transformers`), generating on its own code (`rollout/hf_generate.py`; issue 42).

PPO (the critic's GAE makes every step's gradient nonzero; GRPO's would be 0 on a model that never answers
right) at two Ray ranks against one process: the same tokens (keyed sampling), every learned metric within
1e-4 (the ranks sum their halves in another order). A run resumed from its step-2 checkpoint is the same
computation as the one that never stopped: `==`.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.errors import ConfigError
from tests.trainer.test_distributed_trainer import ROOT, compare_with_one_process, run
from tests.trainer.test_trainer import in_repo, learned

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(600)]
ON_TRANSFORMERS = [f"{role}.{key}" for role in ("actor", "critic", "reference")
                   for key in ("engine=fsdp", "fsdp.modeling=transformers")]


def write_gpt2(path):
    """A 2-layer GPT-2 over the demo model's 16-token vocabulary (its tokenizer beside it), seeded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=16, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "hybridflow/assets/demo_model" / name, path / name)
    return path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return write_gpt2(tmp_path_factory.mktemp("gpt2") / "model")


def test_ppo_on_a_gpt2_at_two_ray_ranks_matches_one_process_resumes_and_exports_a_gpt2(tmp_path, gpt2, capsys):
    """Actor, critic (GPT2Model and a zero head) and reference all sharded by FSDP2 over two Ray processes;
    each rank's generator (a whole GPT2LMHeadModel) refilled by the bucketed all-gather after each update,
    bytes = plan. Three steps equal one process within 1e-4; the one-process run resumed from step 2 takes
    step 3 exactly; the export is a GPT-2 transformers loads, holding the trained weights, and `hybridflow
    reshard --to hf` of the last checkpoint writes the same tensors."""
    import transformers

    from hybridflow.models.checkpoint import load_hf_state_dict

    reward = tmp_path / "reward.py"  # a score that varies with the response: a random GPT-2 never adds right
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(sum(map(ord, solution_str)) % 7) / 7\n")
    common = [f"model.path={gpt2}", *ON_TRANSFORMERS, "trainer.total_steps=3", "data.val_files=[]",
              f"reward.function={reward}:score"]
    one_summary, one = run("tiny-ppo.yaml", tmp_path / "one", *common, "trainer.save_every=1")
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in one if r["step"] > 1)
    _, two = run("tiny-ppo.yaml", tmp_path / "two", *common, "trainer.save_every=0", "trainer.n_devices=2",
                 "trainer.launcher=ray")
    for r in (r for r in two if r["step"] > 0):
        assert r["reshard/bytes_received"] == r["reshard/plan_bytes"] > 0, r["step"]
    compare_with_one_process("ppo on a gpt2, every role on transformers, 2 ranks", two, one, steps=(1, 2, 3))

    shutil.rmtree(one_summary["run_dir"] / "checkpoints" / "step_000003")
    _, again = run("tiny-ppo.yaml", tmp_path / "one", *common, "trainer.save_every=1", "trainer.resume=auto")
    assert learned(again)[3] == learned(one)[3]

    exported = Path(one_summary["hf_actor"])
    assert json.loads((exported / "config.json").read_text())["model_type"] == "gpt2"
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    weights = load_hf_state_dict(exported)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert all(torch.equal(p.detach(), weights[n]) for n, p in model.named_parameters())
    start = load_hf_state_dict(gpt2)
    assert not all(torch.equal(weights[n], start[n]) for n in weights)  # trained
    # `hybridflow reshard` turns its last checkpoint (DCP shards) into the same HF model, and only into HF
    from hybridflow.cli import main

    step = one_summary["run_dir"] / "checkpoints" / "step_000003"
    assert main(["reshard", str(step), str(tmp_path / "converted"), "--to", "hf", "--config", str(gpt2),
                 "--no-progress"]) == 0
    converted = load_hf_state_dict(tmp_path / "converted")
    assert sorted(converted) == sorted(weights) and all(torch.equal(converted[k], weights[k]) for k in weights)
    capsys.readouterr()
    assert main(["reshard", str(step), str(tmp_path / "dist"), "--to", "dist", "--config", str(gpt2)]) == 2
    assert "--to: dist: model_type 'gpt2' is not supported" in capsys.readouterr().err
    # `load_hf_model` (the DataFlow API, `hybridflow eval`) generates with it on its own code
    from hybridflow.rollout.hf import load_hf_model
    from hybridflow.rollout.hf_generate import HFGenerator

    loaded = load_hf_model(exported)
    assert isinstance(loaded.backend, HFGenerator) and type(loaded.model).__name__ == "GPT2LMHeadModel"
    [(prompt, response)] = loaded.generate(["123+456="], max_new_tokens=4)
    assert prompt == "123+456=" and isinstance(response, str)
    with pytest.raises(ValueError, match="with the built-in engine only"):
        load_hf_model(exported, engine="vllm")


@pytest.mark.parametrize("overrides, blocker", [
    ([], "actor.engine=megatron"),
    (ON_TRANSFORMERS[:2], "reference.engine=megatron"),
    ([*ON_TRANSFORMERS[:5], "reference.fsdp.modeling=hybridflow"], "reference.fsdp.modeling=hybridflow"),  # fsdp, own code
    ([*ON_TRANSFORMERS, "rollout.engine=vllm"], "rollout.engine=vllm"),
])
def test_a_model_only_transformers_builds_needs_every_role_on_transformers(tmp_path, gpt2, overrides, blocker):
    """Read before any worker starts: a ConfigError at model.path saying why the decoder does not build it
    and which setting of the run needs the decoder."""
    from hybridflow.config.inputs import load_model_config
    from hybridflow.config.plan import RunPlan
    from hybridflow.config.validate import needs_decoder

    cfg = in_repo(load_config(ROOT / "configs/tiny-ppo.yaml", [f"trainer.output_dir={tmp_path}", *overrides]))
    cfg.model.path = str(gpt2)
    with pytest.raises(ConfigError) as err:
        load_model_config(cfg.model.path, "model.path", needs_decoder(cfg, RunPlan.from_config(cfg)))
    assert err.value.path == "model.path"
    assert "model_type 'gpt2' is not supported" in str(err.value) and f"this run has {blocker}" in str(err.value)


def test_a_llama_actor_under_megatron_with_a_gpt2_critic_on_transformers(tmp_path, gpt2):
    """critic.model_path names a model only transformers builds: the critic alone must run on it (the actor
    and reference stay on megatron-core); PPO runs in one process and the critic learns (at step 2: step 1's
    16 samples all scored 0 here, with the head at zero). Under megatron the GPT-2 critic is refused."""
    from hybridflow.config.inputs import load_model_config
    from hybridflow.config.plan import RunPlan
    from hybridflow.config.validate import needs_decoder

    critic = [f"critic.model_path={gpt2}", "critic.engine=fsdp", "critic.fsdp.modeling=transformers"]
    _, records = run("tiny-ppo.yaml", tmp_path / "mixed", *critic, "trainer.total_steps=2", "data.val_files=[]",
                     "trainer.save_every=0")
    assert records[-1]["step"] == 2 and records[-1]["critic/grad_norm"] > 0
    cfg = in_repo(load_config(ROOT / "configs/tiny-ppo.yaml", [f"trainer.output_dir={tmp_path}",
                                                                f"critic.model_path={gpt2}"]))
    with pytest.raises(ConfigError, match="critic.model_path: model_type 'gpt2' is not supported.*"
                                          "this run has critic.engine=megatron"):
        load_model_config(str(gpt2), "critic.model_path", needs_decoder(cfg, RunPlan.from_config(cfg), True))


def test_a_model_only_transformers_builds_is_checked_against_its_weights(tmp_path, gpt2):
    """Its safetensors' names and shapes are those of the transformers model its config.json builds."""
    from hybridflow.config.inputs import load_model_config

    bad = tmp_path / "bad"
    shutil.copytree(gpt2, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "n_embd": 32}))
    with pytest.raises(ConfigError, match=r"model\.path: .*config.json makes transformer.wte.weight \[16, 32\]"):
        load_model_config(str(bad), "model.path", None)
    assert not load_model_config(str(gpt2), "model.path", None).native


def test_a_model_whose_buffers_transformers_cannot_recompute_is_refused_before_any_worker(tmp_path):
    """Gemma scales its embedding by a buffer that no checkpoint holds; built on the meta device (as every
    rank builds its shard) nothing would fill it: a ConfigError naming the buffer, at model.path."""
    import transformers

    from hybridflow.config.inputs import load_model_config

    config = transformers.AutoConfig.for_model("gemma", num_hidden_layers=1, hidden_size=32, intermediate_size=48,
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                               vocab_size=16, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma")
    with pytest.raises(ConfigError, match=r"model\.path: model_type 'gemma' is not supported.*"
                                          r"model\.embed_tokens\.embed_scale"):
        load_model_config(str(tmp_path / "gemma"), "model.path", None)
