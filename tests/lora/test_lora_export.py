"""The LoRA actor's exports (issue 62 item 5): the merged HF model, and a PEFT directory that `peft` loads onto
the base model giving the merged model's logits."""
import json

import pytest
import torch

from tests.engine.conftest import layout_case, write_layout_model
from tests.lora.common import LORA, full_adapters, full_shape

pytestmark = pytest.mark.usefixtures("megatron_world")


@pytest.mark.slow
def test_the_peft_directory_on_the_base_model_gives_the_merged_exports_logits(tmp_path):
    """Adapters set to non-zero A and B on a one-rank engine: `hf_state_dict` is the merged W + s * B A (the
    HF export), and the PEFT directory (q/k/v and gate/up cut from the fused adapters) loaded by
    `peft.PeftModel.from_pretrained` onto the base model gives that export's logits; without the adapters
    the base model's logits are far from them (the test can fail)."""
    import peft
    import transformers

    from hybridflow.checkpoint.peft import CONFIG_FILE, export_peft
    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine
    from hybridflow.models.checkpoint import save_hf_checkpoint

    case = layout_case(write_layout_model(tmp_path / "base"))
    engine = MegatronEngine(case.cfg, ParallelConfig(), case.optim, total_steps=10, lora=LORA)
    engine.load_hf_checkpoint(case.path)
    with torch.no_grad():
        for a in engine.lora.adapted:
            full_a, full_b = full_adapters(a.key, LORA.rank, *full_shape(a, 1))
            a.module.lora_A.copy_(0.3 * full_a)
            a.module.lora_B.copy_(0.3 * full_b)
    save_hf_checkpoint(engine.hf_state_dict(), case.cfg.to_hf_dict(), tmp_path / "merged")
    export_peft(engine, tmp_path / "peft", case.path)
    config = json.loads((tmp_path / "peft" / CONFIG_FILE).read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]

    ids = torch.randint(3, case.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        merged = load(tmp_path / "merged").eval()(input_ids=ids).logits
        base = load(case.path).eval()
        plain = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-5, atol=1e-5)
    assert (plain - merged).abs().max() > 0.1
