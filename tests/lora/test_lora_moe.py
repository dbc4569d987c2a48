"""LoRA on a mixture-of-experts model's experts (issue 62 item 1): megatron-core's SequentialMLP experts of the
tiny Qwen3-MoE take adapters on linear_fc1 / linear_fc2 beside the attention's; at one process every expert's
adapters train while its weights stay the base's, and at dp2 x ep2 (each rank its own experts' adapters) three
GRPO steps equal one process's; the PEFT export carries the experts' adapters in peft's layout for transformers'
fused experts."""
import pytest
import torch

from tests.trainer.test_distributed_trainer import compare_with_one_process, run
from tests.trainer.test_moe_layouts import _steps, qwen3_moe_shaped_model

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(600), pytest.mark.slow]
MOE_LORA = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=3e-3", "reference.enabled=true",
            "reference.engine=adapters_off", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]


@pytest.fixture(scope="module")
def moe_one_process(tmp_path_factory):
    """The tiny Qwen3-MoE's path, and its LoRA GRPO run on one process (step 3 saved)."""
    path = qwen3_moe_shaped_model(tmp_path_factory.mktemp("qwen3moe"))
    summary, records = run("tiny-grpo.yaml", tmp_path_factory.mktemp("one"), *_steps(path), *MOE_LORA,
                           "trainer.save_every=3")
    return path, summary, records


def test_expert_adapters_train_and_the_merged_export_is_the_base_plus_their_delta(moe_one_process):
    """Every expert of every layer has adapters, and after three steps every one of their B is non-zero (each
    expert took gradients: B starts at zero); the checkpoint holds adapters only, and the HF export's expert
    weights are exactly the base's plus s * B A of the saved adapters (the base weights did not move)."""
    from hybridflow.engine.lora import lora_delta
    from hybridflow.models.bridge import get_bridge
    from hybridflow.models.checkpoint import load_hf_state_dict
    from hybridflow.models.config import DecoderConfig

    path, summary, _ = moe_one_process
    shard = torch.load(next((summary["run_dir"] / "checkpoints" / "step_000003" / "actor").glob("*.pt")))
    adapters = shard["model"]
    assert all(".lora_" in name for name in adapters)
    expert_b = {k: v for k, v in adapters.items() if ".local_experts." in k and k.endswith("lora_B")}
    assert len(expert_b) == 4 * 4 * 2  # 4 layers, 4 experts, fc1 and fc2
    assert all(b.abs().max() > 0 for b in expert_b.values()), [k for k, b in expert_b.items() if not b.any()]
    cfg = DecoderConfig.from_pretrained(path)
    bridge, base, export = get_bridge(cfg), load_hf_state_dict(path), load_hf_state_dict(summary["hf_actor"])
    checked = 0
    for name, b in expert_b.items():
        key = name[:-len(".lora_B")]
        delta = lora_delta(adapters[key + ".lora_A"], b, 16 / 8, torch.float32)
        for hf_name, part in bridge.megatron_to_hf({key + ".weight": delta}, partial=True).items():
            assert torch.equal(export[hf_name], base[hf_name] + part), hf_name
            checked += 1
    assert checked == 4 * 4 * 3  # gate, up and down of each expert


def assert_peft_gives_the_merged_logits(base_path, export) -> None:
    """The PEFT directory beside the merged export (the experts' adapters under peft's `target_parameters`, on
    transformers' fused expert parameters) loaded by `peft.PeftModel.from_pretrained` onto the base Qwen3-MoE
    gives the merged export's logits (float32; the two sum the expert deltas in other orders: 1e-5); the base
    alone is far from them."""
    import json

    import peft
    import transformers

    config = json.loads((export / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        base = load(base_path).eval()
        ids = torch.randint(3, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
        merged = load(export).eval()(input_ids=ids).logits
        plain = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, export / "peft").eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-5, atol=1e-5)
    assert (plain - merged).abs().max() > 1e-3


def test_the_peft_export_of_expert_adapters_loads_onto_the_base_with_the_merged_logits(moe_one_process):
    path, summary, _ = moe_one_process
    assert_peft_gives_the_merged_logits(path, summary["hf_actor"])


def test_lora_grpo_on_the_experts_at_dp2_ep2_matches_one_process(tmp_path, moe_one_process):
    """Each rank trains its two experts' adapters (reduced over the expert-data-parallel ranks, none here) and
    the attention's (averaged over dp); the rollout gathers the other rank's merged experts. Three steps'
    learned metrics within 1e-5 relative (1e-6 absolute) of one process."""
    path, _, one = moe_one_process
    summary, records = run("tiny-grpo.yaml", tmp_path / "dp2ep2", "trainer.launcher=ray", "trainer.n_devices=2",
                           "actor.parallel.ep=2", *_steps(path), *MOE_LORA)
    assert one[3]["actor/kl_loss"] > 0
    compare_with_one_process("LoRA GRPO on the tiny qwen3-moe's experts at dp2ep2", records, one, steps=(1, 2, 3),
                             rel=1e-5, abs_=1e-6)
    assert_peft_gives_the_merged_logits(path, summary["hf_actor"])  # every rank's experts' adapters, exchanged
