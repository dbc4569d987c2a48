"""LoRA GRPO on the FSDP2 engine (peft adapters) through the trainer: at dp2 on Ray equal to one process over three
steps, on hybridflow's decoder and on the `transformers` model; and the first rollout, from zero-initialised B, is
the base model's."""
import json

import pytest
from safetensors import safe_open

from tests.lora.test_lora_layouts import LORA_GRPO
from tests.trainer.test_distributed_trainer import compare_with_one_process, run

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(600), pytest.mark.slow]
FSDP = {"hybridflow": ["actor.engine=fsdp"],
        "transformers": ["actor.engine=fsdp", "actor.fsdp.modeling=transformers"]}
ROLLOUT = ("reward/", "response/")  # what step 1's rollout alone decides


@pytest.mark.parametrize("modeling", FSDP)
def test_fsdp_lora_grpo_at_dp2_matches_one_process(tmp_path, modeling):
    """Adapters sharded by FSDP2 with their base, gradients reduce-scattered over two ranks, the rollout from
    the gathered merged weights and the KL against the adapters-off reference (peft's disable_adapter): three
    steps' learned metrics within 1e-5 relative (1e-6 absolute) of one process; the PEFT directory written
    beside the merged export holds every adapted linear's A and B."""
    _, one = run("tiny-grpo.yaml", tmp_path / "one", *FSDP[modeling], *LORA_GRPO)
    summary, dp2 = run("tiny-grpo.yaml", tmp_path / "dp2", "trainer.launcher=ray", "trainer.n_devices=2",
                       *FSDP[modeling], *LORA_GRPO)
    assert one[3]["actor/kl_loss"] > 0  # the policy left the base model
    compare_with_one_process(f"FSDP LoRA GRPO ({modeling}) at dp2", dp2, one, steps=(1, 2, 3), rel=1e-5, abs_=1e-6)
    adapter = json.loads((summary["hf_actor"] / "peft" / "adapter_config.json").read_text())
    with safe_open(summary["hf_actor"] / "peft" / "adapter_model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert adapter["r"] == 8 and len(shapes) == 4 * 7 * 2, sorted(shapes)[:4]  # 4 layers, 7 HF linears, A and B
    assert shapes["base_model.model.model.layers.3.mlp.down_proj.lora_A.weight"] == (8, 384)


def test_the_first_fsdp_lora_rollout_is_the_base_models(tmp_path):
    """B starts at zero, so the merged weights the rollout gathers are the base's bit for bit and keyed sampling
    draws the same responses: step 1's rollout figures equal those of the same run without adapters exactly."""
    one_step = ["trainer.total_steps=1", "trainer.val_every=0", "trainer.save_every=0", "actor.ppo_mini_batch_size=8"]
    _, lora = run("tiny-grpo.yaml", tmp_path / "lora", *FSDP["hybridflow"], *one_step, "actor.lora.rank=8",
                  "actor.lora.alpha=16")
    _, base = run("tiny-grpo.yaml", tmp_path / "base", *FSDP["hybridflow"], *one_step)
    figures = {k: v for k, v in base[1].items() if k.startswith(ROLLOUT)}
    assert len(figures) > 3 and figures == {k: v for k, v in lora[1].items() if k.startswith(ROLLOUT)}
    assert lora[1]["actor/grad_norm"] != base[1]["actor/grad_norm"]  # the updates differ: adapters vs all weights
