"""LoRA on the FSDP2 engine through peft (engine/fsdp_lora.py), at one process, on hybridflow's decoder and on the
`transformers` model: zero-initialised B generates from the base model's weights exactly; an update moves the
adapters only; the adapters-off forward is the frozen base model's; the generation weights and the HF export are
the merged W + s * B A; a checkpoint holds the adapters and their Adam state, and a resumed engine takes the same
next update; the PEFT directory loaded by peft onto the base gives the merged export's logits."""
import pytest
import torch

from hybridflow.config.schema import LoRAConfig
from hybridflow.data import fields as F
from tests.engine.conftest import layout_case, write_layout_model
from tests.lora.common import assert_peft_loads_as_the_merged_export

pytestmark = [pytest.mark.usefixtures("megatron_world"), pytest.mark.slow]
LORA = LoRAConfig(rank=4, alpha=8.0)
MODELINGS = ("hybridflow", "transformers")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return layout_case(write_layout_model(tmp_path_factory.mktemp("fsdp_lora_model")))


def fsdp_engine(case, modeling: str, optim=True, lora=LORA):
    from hybridflow.engine.fsdp import FSDPEngine
    from hybridflow.engine.fsdp_hf import TransformersFSDPEngine

    options = dict(optim=case.optim if optim else None, total_steps=10, lora=lora)
    engine = (TransformersFSDPEngine(case.path, case.cfg, **options) if modeling == "transformers"
              else FSDPEngine(case.cfg, **options))
    engine.load_hf_checkpoint(case.path)
    return engine


def whole(t):
    """A parameter's whole tensor: a DTensor's gathered, or a plain one (FSDP keeps the root's whole after a
    forward while the engine trains)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def log_probs(engine, batch, case):
    """The response log-probs of `engine`: as the actor computes them when it trains, else as the reference."""
    from hybridflow.config.schema import ReferenceConfig
    from hybridflow.roles import Actor, Reference

    if engine.optimizer is not None:
        return Actor(case.actor_cfg, engine).compute_log_probs(batch, 3)[F.OLD_LOG_PROBS]
    return Reference(ReferenceConfig(log_prob_micro_batch_size=3), engine).compute_ref_log_probs(batch)[F.REF_LOG_PROBS]


@pytest.mark.parametrize("modeling", MODELINGS)
def test_fsdp_lora_trains_adapters_only_generates_merged_and_its_adapters_off_reference_is_the_base(
        case, modeling, tmp_path):
    from hybridflow.engine.lora import AdaptersOff
    from hybridflow.hybrid_engine.fsdp_gather import FSDPGatheredWeights
    from hybridflow.roles import Actor

    engine, frozen = fsdp_engine(case, modeling), fsdp_engine(case, modeling, optim=False, lora=None)
    trainable = {n for n, p in engine.named_params().items() if p.requires_grad}
    per_layer = 4 if modeling == "hybridflow" else 7  # fused qkv / [gate; up], or HF's q, k, v, o, gate, up, down
    assert len(trainable) == 2 * per_layer * case.cfg.num_layers and all(".lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in engine.optimizer.param_groups) == len(trainable)
    # Zero B: the generation weights are the base model's, bit for bit, and so is every rollout from them.
    generation, base_generation = FSDPGatheredWeights(engine), FSDPGatheredWeights(frozen)
    base = dict(base_generation.model.named_parameters())
    assert all(torch.equal(w, base[n]) for n, w in generation.model.named_parameters())
    assert torch.equal(log_probs(engine, case.batch, case), log_probs(frozen, case.batch, case))

    before = {n: whole(p).clone() for n, p in engine.named_params().items()}
    Actor(case.actor_cfg, engine).update(case.batch, step=0)
    moved = {n for n, p in engine.named_params().items() if not torch.equal(whole(p), before[n])}
    assert moved and moved <= trainable
    # Generation (refreshed after the update, as the trainer does) and the export: W + s * B A (peft's merge),
    # the base itself untouched.
    generation.refresh()
    merged = engine.full_generation_state()
    scale = LORA.alpha / LORA.rank
    for name, layer in engine.lora.layers.items():
        a, b = whole(layer.lora_A["default"].weight), whole(layer.lora_B["default"].weight)
        w = whole(layer.base_layer.weight)
        assert torch.equal(w, before[name.replace(".weight", ".base_layer.weight")])
        key = name[len("decoder."):] if modeling == "hybridflow" else name[len("model."):]
        torch.testing.assert_close(merged[key], w + scale * b @ a, rtol=0, atol=1e-7)
    gen = dict(generation.model.named_parameters())
    if modeling == "hybridflow":
        assert all(torch.equal(gen[n], merged[n]) for n in merged)
    assert any(not torch.equal(gen[n], base[n]) for n in gen)
    # The adapters-off reference: the frozen base's log-probs exactly; the trained actor's differ.
    assert torch.equal(log_probs(AdaptersOff(engine), case.batch, case), log_probs(frozen, case.batch, case))
    assert not torch.equal(log_probs(engine, case.batch, case), log_probs(frozen, case.batch, case))
    # A checkpoint: the adapters and their Adam state; a fresh engine loading it takes the same next update.
    engine.save(tmp_path / "ckpt")
    resumed = fsdp_engine(case, modeling)
    resumed.load(tmp_path / "ckpt")
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    assert all(".lora_" in k for k in engine._state()["model"]) and "optimizer" in engine._state()
    assert set(get_model_state_dict(resumed.module)) == set(get_model_state_dict(engine.module))
    again = Actor(case.actor_cfg, resumed).update(case.batch, step=1)
    assert again == Actor(case.actor_cfg, engine).update(case.batch, step=1)


@pytest.mark.parametrize("modeling", MODELINGS)
def test_the_fsdp_peft_directory_on_the_base_model_gives_the_merged_exports_logits(case, modeling, tmp_path):
    """Adapters made non-zero by two updates; the PEFT directory (hybridflow's fused adapters cut by the bridge,
    a transformers model's written as they are) loaded by `peft.PeftModel.from_pretrained` onto the base gives
    the merged HF export's logits; the base alone is far from them."""
    from hybridflow.config.schema import OptimConfig
    from hybridflow.roles import Actor

    engine = fsdp_engine(case, modeling)
    engine.optim_cfg = OptimConfig(lr=0.2, eps=1.0, grad_clip=100.0)
    for group in engine.optimizer.param_groups:  # large steps: B far from zero
        group["lr"] = 0.2
    for step in range(2):
        Actor(case.actor_cfg, engine).update(case.batch, step=step)
    assert_peft_loads_as_the_merged_export(engine, case, tmp_path, 1e-2)
