"""What the LoRA engine tests share: a tiny model, random (non-zero) adapters, one gradient pass."""
import zlib

import torch

from hybridflow.config.schema import LoRAConfig
from hybridflow.data import fields as F

LORA = LoRAConfig(rank=4, alpha=8.0)


def full_adapters(key: str, rank: int, d_out: int, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rank, d_in] and a non-zero B [d_out, rank] for the adapter `key`, the same in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return 0.3 * torch.randn(rank, d_in, generator=g), 0.3 * torch.randn(d_out, rank, generator=g)


def full_shape(adapted, tp: int) -> tuple[int, int]:
    """(d_out, d_in) of an adapted layer's whole weight, from its local shard at `tp`."""
    d_out, d_in = adapted.module.weight.shape
    return (d_out * tp, d_in) if adapted.column else (d_out, d_in * tp)


def gradient_pass(engine, batch) -> None:
    """One forward and backward of -sum(log-prob * advantage) over the batch; gradients in `main_grad`."""
    from hybridflow.roles.batching import response_log_probs

    def step(output, mb):
        logp, _ = response_log_probs(output, mb, engine, 1.0)
        return -(logp * mb[F.ADVANTAGES]).sum(), {}

    engine.zero_grad()
    engine.run([batch], step)


def assert_peft_loads_as_the_merged_export(engine, case, tmp_path, min_change: float) -> None:
    """`engine`'s merged HF export and PEFT directory: transformers' model of the directory on the base at
    `case.path` gives the merged export's logits (1e-5), which differ from the base's by more than
    `min_change` (the adapters did something)."""
    import json

    import peft
    import transformers

    from hybridflow.checkpoint.peft import CONFIG_FILE, export_peft
    from hybridflow.models.checkpoint import save_hf_checkpoint

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
    assert (plain - merged).abs().max() > min_change
