"""LoRA GRPO through the trainer (issue 62): at tp2, pp2 and dp2 on Ray, equal to one process over three steps,
with the adapters-off reference's KL in the loss."""
import json

import pytest
from safetensors import safe_open

from tests.trainer.test_distributed_trainer import compare_with_one_process, run

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(400), pytest.mark.slow]

# Rank 8 on every linear, the reference the actor with its adapters off and its KL in the loss (so step 1's
# update already reads it), one mini-batch a step (at dp > 1 each rank cuts its mini-batches from its own
# rows), a learning rate at which the rollouts of steps 2 and 3 differ from the base model's.
LORA_GRPO = ["trainer.total_steps=3", "trainer.val_every=0", "trainer.save_every=0", "actor.ppo_mini_batch_size=8",
             "actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=3e-3", "reference.enabled=true",
             "reference.engine=adapters_off", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]
LAYOUTS = {"tp2": ["actor.parallel.tp=2"], "pp2": ["actor.parallel.pp=2"], "dp2": []}


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The one-process run (saved every step, for the resume test): its output directory and its records."""
    out = tmp_path_factory.mktemp("one")
    return out, run("tiny-grpo.yaml", out, *LORA_GRPO, "trainer.save_every=1")[1]


@pytest.fixture(scope="module")
def one_process(one_process_run):
    return one_process_run[1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_grpo_at_each_layout_matches_one_process(tmp_path, one_process, layout):
    """Adapters sharded with TP as their layers' weights (tp2: the rollout generates at tg = 1 from the merged
    W + s * B A gathered by the reshard plan), split over two stages (pp2), or replicated with their gradients
    averaged by Megatron DDP (dp2, views of the merged weights): three steps' learned metrics, KL to the
    adapters-off reference included, equal one process's within 1e-5 relative (1e-6 absolute)."""
    summary, records = run("tiny-grpo.yaml", tmp_path / layout, "trainer.launcher=ray", "trainer.n_devices=2",
                     *LAYOUTS[layout], *LORA_GRPO)
    assert one_process[3]["actor/kl_loss"] > 0 and records[3]["lora/merged_bytes"] > 0  # the policy left the base
    compare_with_one_process(f"LoRA GRPO at {layout}", records, one_process, steps=(1, 2, 3), rel=1e-5, abs_=1e-6)
    # The export: the merged model, and the adapters (gathered over TP / the stages) as a PEFT directory.
    adapter = json.loads((summary["hf_actor"] / "peft" / "adapter_config.json").read_text())
    with safe_open(summary["hf_actor"] / "peft" / "adapter_model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert adapter["r"] == 8 and len(shapes) == 4 * 7 * 2, sorted(shapes)[:4]  # 4 layers, 7 HF linears, A and B
    assert shapes["base_model.model.model.layers.3.mlp.down_proj.lora_A.weight"] == (8, 384)


def resumable(full, where):
    """A copy at `where` of the one-process run `full` as its step-2 checkpoint left it."""
    import shutil

    shutil.copytree(full, where)
    shutil.rmtree(where / "tiny-grpo" / "checkpoints" / "step_000003")
    (where / "tiny-grpo" / "checkpoints" / "latest").write_text("step_000002\n")
    return where


def test_a_lora_run_resumed_from_its_checkpoint_takes_the_same_third_step(tmp_path, one_process_run):
    """Saved every step (each shard the adapters and their Adam state, no base weight), resumed from step 2's
    checkpoint with the base read again from model.path, here the same model copied to another path (the
    checkpoint's base is checked by content, not path): step 3 equals the uninterrupted run's."""
    import torch

    from tests.lora.test_lora_base import copy_of_demo
    from tests.trainer.test_trainer import learned

    full, records = one_process_run
    common = [*LORA_GRPO, "trainer.save_every=1"]
    step2 = full / "tiny-grpo" / "checkpoints" / "step_000002"
    shard = torch.load(next((step2 / "actor").glob("*.pt")))
    assert shard["model"] and all(".lora_" in name for name in shard["model"]) and "optimizer" in shard
    assert json.loads((step2 / "trainer.json").read_text())["base"]["path"].endswith("demo_model")
    moved = copy_of_demo(tmp_path / "moved_base")
    _, again = run("tiny-grpo.yaml", resumable(full, tmp_path / "resumed"), *common, "trainer.resume=auto",
                   f"model.path={moved}")
    for key, value in learned(records)[3].items():
        assert learned(again)[3][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_resuming_lora_adapters_onto_another_base_model_is_refused_before_a_step(tmp_path, one_process_run):
    """The step-2 adapters resumed with model.path a fine-tune of their base (one matrix scaled by 1.01): a
    ConfigError on model.path naming both models, raised before any step runs (no step 3 is saved)."""
    from hybridflow.errors import ConfigError
    from tests.lora.test_lora_base import copy_of_demo

    def nudge(state):
        name = next(n for n in sorted(state) if n.endswith("layers.1.self_attn.o_proj.weight"))
        state[name].mul_(1.01)

    other = copy_of_demo(tmp_path / "tuned_base", change=nudge)
    where = resumable(one_process_run[0], tmp_path / "resumed")
    with pytest.raises(ConfigError) as err:
        run("tiny-grpo.yaml", where, *LORA_GRPO, "trainer.save_every=1", "trainer.resume=auto",
            f"model.path={other}")
    assert err.value.path == "model.path" and str(other) in str(err.value) and "demo_model" in str(err.value)
    assert not (where / "tiny-grpo" / "checkpoints" / "step_000003").exists()
