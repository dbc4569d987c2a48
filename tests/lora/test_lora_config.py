"""The LoRA config checks (config/validate_lora.py): each bad value is one ConfigError naming its key, before
any worker starts."""
import pytest

from hybridflow.config.loader import load_config
from hybridflow.config.plan import RunPlan
from hybridflow.config.validate import check_plan
from hybridflow.errors import ConfigError
from hybridflow.models.config import DecoderConfig
from tests.trainer.test_distributed_trainer import ROOT
from tests.trainer.test_trainer import in_repo


def load(tmp_path, *overrides):
    return load_config(ROOT / "configs/tiny-grpo.yaml", [f"trainer.output_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("overrides,key,words", [
    (["actor.lora.rank=-1"], "actor.lora.rank", "-1 is negative"),
    (["actor.lora.rank=8", "actor.lora.alpha=0"], "actor.lora.alpha", "0.0 must be positive"),
    (["actor.lora.rank=8", "actor.lora.dropout=1.0"], "actor.lora.dropout", "1.0 is not a probability"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[linear_qkv,q_proj]"], "actor.lora.target_modules",
     "'q_proj'"),
    (["reference.enabled=true", "reference.engine=adapters_off"], "reference.engine", "actor.lora.rank > 0"),
])
def test_bad_lora_settings_are_a_config_error_naming_the_key(tmp_path, overrides, key, words):
    with pytest.raises(ConfigError, match=key) as caught:
        load(tmp_path, *overrides)
    assert caught.value.path == key and words in str(caught.value)


def test_lora_on_the_critic_is_an_unknown_key(tmp_path):
    """Only the actor takes adapters (a value head trains whole): the loader refuses critic.lora by its path."""
    with pytest.raises(ConfigError, match="critic.lora"):
        load(tmp_path, "critic.lora.rank=8")


def test_a_rank_beyond_an_adapted_matrix_and_expert_adapters_where_not_built_are_refused_against_the_model(tmp_path):
    """Checked against the model's config.json (`check_plan`): the demo model's hidden size is 128, so rank 129
    adds nothing to any matrix; an MoE model's MLP adapters sit on its experts, built on the megatron engine at
    tp = 1 (refused at tp 2 and under FSDP), and its experts' 96 features bound the rank."""
    cfg = in_repo(load(tmp_path, "actor.lora.rank=129"))
    model = DecoderConfig.from_pretrained(cfg.model.path)
    with pytest.raises(ConfigError, match="actor.lora.rank: 129 exceeds linear_qkv's smaller side"):
        check_plan(cfg, RunPlan.from_config(cfg), model)
    cfg.actor.lora.rank = 8
    check_plan(cfg, RunPlan.from_config(cfg), model)
    moe = DecoderConfig.from_hf_dict({**model.to_hf_dict(), "model_type": "qwen3_moe",
                                      "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                                      "num_experts_per_tok": 2, "moe_intermediate_size": 96})
    check_plan(cfg, RunPlan.from_config(cfg), moe)
    cfg.actor.lora.rank = 97
    with pytest.raises(ConfigError, match=r"actor.lora.rank: 97 exceeds linear_fc2's smaller side \(96"):
        check_plan(cfg, RunPlan.from_config(cfg), moe)
    for override, words in (("actor.parallel.tp=2", "not built at actor.parallel.tp=2"),
                            ("actor.engine=fsdp", "with actor.engine=fsdp")):
        other = in_repo(load(tmp_path, "actor.lora.rank=8", override, "trainer.n_devices=2",
                             "actor.parallel.sequence_parallel=true" if "tp" in override else "trainer.val_every=0"))
        with pytest.raises(ConfigError, match=f"actor.lora.target_modules: .* {words}"):
            check_plan(other, RunPlan.from_config(other), moe)


def test_lora_on_the_fsdp_engine_loads_and_an_architecture_outside_the_llama_family_is_refused(tmp_path):
    """LoRA under FSDP (peft) with the adapters-off reference passes the checks; on a model only transformers
    builds (GPT-2 here, whose linears are c_attn / c_fc) the targets name nothing: refused by key."""
    cfg = in_repo(load(tmp_path, "actor.lora.rank=8", "actor.engine=fsdp", "reference.enabled=true",
                       "reference.engine=adapters_off", "actor.fsdp.modeling=transformers"))
    model = DecoderConfig.from_pretrained(cfg.model.path)
    check_plan(cfg, RunPlan.from_config(cfg), model)
    gpt2 = DecoderConfig.foreign({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2,
                                  "n_embd": 64, "n_head": 4, "vocab_size": 100}, "GPT-2 is not a Llama-family model")
    with pytest.raises(ConfigError, match="actor.lora.rank: 8 on a 'gpt2' model"):
        check_plan(cfg, RunPlan.from_config(cfg), gpt2)
