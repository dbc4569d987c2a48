"""The LoRA actor's exports (issue 62 item 5): the merged HF model, and a PEFT directory that `peft` loads onto
the base model giving the merged model's logits."""

import pytest
import torch

from tests.engine.conftest import layout_case, write_layout_model
from tests.lora.common import LORA, assert_peft_loads_as_the_merged_export, full_adapters, full_shape

pytestmark = pytest.mark.usefixtures("megatron_world")


@pytest.mark.slow
def test_the_peft_directory_on_the_base_model_gives_the_merged_exports_logits(tmp_path):
    """Adapters set to non-zero A and B on a one-rank engine: `hf_state_dict` is the merged W + s * B A (the
    HF export), and the PEFT directory (q/k/v and gate/up cut from the fused adapters) loaded by
    `peft.PeftModel.from_pretrained` onto the base model gives that export's logits; without the adapters
    the base model's logits are far from them (the test can fail)."""
    from hybridflow.config.schema import ParallelConfig
    from hybridflow.engine import MegatronEngine

    case = layout_case(write_layout_model(tmp_path / "base"))
    engine = MegatronEngine(case.cfg, ParallelConfig(), case.optim, total_steps=10, lora=LORA)
    engine.load_hf_checkpoint(case.path)
    with torch.no_grad():
        for a in engine.lora.adapted:
            full_a, full_b = full_adapters(a.key, LORA.rank, *full_shape(a, 1))
            a.module.lora_A.copy_(0.3 * full_a)
            a.module.lora_B.copy_(0.3 * full_b)
    assert_peft_loads_as_the_merged_export(engine, case, tmp_path, 0.1)
