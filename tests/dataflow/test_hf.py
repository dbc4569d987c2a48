"""load_hf_model: causal LMs on the built-in engine, sequence classifiers as reward models / guards."""
import json
import logging
import shutil
import sys

import pytest
import torch

from hybridflow import Node
from hybridflow.rollout import Generator, factory
from hybridflow.utils import CausalLM, RewardModel, load_hf_model
from hybridflow.models.hf import resolve_device
from tests.dataflow.conftest import DEMO, TINY_RM

PROMPTS = ["042+917=", "123+456=", "999+001=", "500+500=", "07+5="]


def test_missing_or_unknown_models_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model path not found: {tmp_path / 'nope'}"):
        load_hf_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"no config.json in {tmp_path}"):
        load_hf_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError, match=r"\['BertForMaskedLM'\] name neither"):
        load_hf_model(tmp_path)
    with pytest.raises(ValueError, match="engine must be one of"):
        load_hf_model(DEMO, engine="trt")


def test_device_map():
    assert resolve_device(None) == resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="controller's placement"):
        resolve_device({"model.layers.0": 0})


def test_causal_lm_greedy_pairs_match_one_by_one(actor):
    assert isinstance(actor, CausalLM) and actor.engine == "builtin"
    pairs = actor.generate(PROMPTS)
    assert [p for p, _ in pairs] == PROMPTS
    assert pairs[0] == ("042+917=", "0969")  # the demo model's (wrong) greedy answer, no <eos> text
    assert pairs == [pair for p in PROMPTS for pair in actor.generate([p])]
    assert actor.generate([]) == []


def test_causal_lm_samples_n_per_prompt_reproducibly(actor):
    pairs = actor.generate(PROMPTS[:2], temperature=1.0, n=3, seed=7, max_new_tokens=8)
    assert [p for p, _ in pairs] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert pairs == actor.generate(PROMPTS[:2], temperature=1.0, n=3, seed=7, max_new_tokens=8)
    assert all(len(r) <= 8 for _, r in pairs)


def test_vllm_missing_warns_and_falls_back(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with caplog.at_level(logging.WARNING, logger="hybridflow.models.hf"):
        with pytest.warns(RuntimeWarning, match="vLLM is not installed.*built-in engine"):
            model = load_hf_model(DEMO, engine="vllm")
    assert model.engine == "builtin" and "vLLM is not installed" in caplog.text
    with pytest.warns(RuntimeWarning, match="vLLM is not installed"):
        node = Node(name="rollout", model=model, engine="vllm", forward_fn=lambda m, p: m.generate(p))
    assert node.engine == "builtin" and node.model.generate(["042+917="]) == [("042+917=", "0969")]


def test_reward_model_scores_batched_as_one_by_one(reward_model):
    assert isinstance(reward_model, RewardModel)
    pairs = [(p, r) for p in PROMPTS for r in ("0959", "1", "05790")]  # different lengths: padding
    batched = reward_model.score(pairs, batch_size=4)
    single = [reward_model(p, r) for p, r in pairs]
    assert all(s.dim() == 0 and s.dtype == torch.float32 for s in single)
    torch.testing.assert_close(torch.tensor(batched), torch.stack(single), rtol=1e-5, atol=1e-5)
    assert len(set(batched)) == len(batched)  # the response matters
    checks = [reward_model.check(p, r) for p, r in pairs]
    assert checks == [s > 0.0 for s in batched] and any(checks) and not all(checks)
    assert [reward_model.check(p, r, threshold=-1e9) for p, r in pairs] == [True] * len(pairs)


def test_two_label_classifier_scores_with_the_last_label(tmp_path):
    import transformers

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_labels=2,
                                      pad_token_id=0)
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_RM / name, tmp_path / name)
    guard = load_hf_model(tmp_path, dtype="float32")
    pairs = [("042+917=", "0959"), ("1+1=", "2")]
    enc = guard.tokenizer([p + r for p, r in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = guard.model(**enc).logits
    assert logits.shape == (2, 2)
    torch.testing.assert_close(torch.tensor(guard.score(pairs)), logits[:, 1])


def test_a_chat_template_renders_the_pair_without_doubling_special_tokens(tmp_path, reward_model):
    shutil.copytree(TINY_RM, tmp_path / "rm")
    config_file = tmp_path / "rm" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{% for m in messages %}{{ bos_token if loop.first }}{{ m['content'] }}{% endfor %}"
    config_file.write_text(json.dumps(config))
    templated = load_hf_model(tmp_path / "rm")
    assert templated.chat and not reward_model.chat
    pairs = [("042+917=", "0959"), ("1+1=", "2")]
    assert templated.score(pairs) == pytest.approx(reward_model.score(pairs), abs=1e-6)


def test_both_engines_of_a_causal_lm_come_from_the_rollout_factory(monkeypatch):
    """The vLLM engine a `CausalLM` uses is the factory's (here a stand-in for `VLLMBackend`), built once
    with the trainer's arguments and the decoder's weights pushed into it; the built-in one is a `Generator`
    on the decoder itself."""
    built = []

    class FakeVLLM:
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs, self.taken = args, kwargs, 0
            built.append(self)

        def load_weights(self, named):
            self.taken += sum(t.numel() * t.element_size() for _, t in named)
            return self.taken

    monkeypatch.setattr(factory, "VLLMBackend", FakeVLLM)
    model = load_hf_model(DEMO, engine="vllm")
    assert model.engine == "vllm" and len(built) == 1 and model.backend is built[0]
    engine = built[0]
    dtype = str(model.model.embed.weight.dtype).removeprefix("torch.")
    assert engine.args == (str(DEMO), model.tokenizer)
    assert engine.kwargs == dict(dtype=dtype, seed=0, device="cpu", bucket_bytes=64 * 2**20, tensor_parallel_size=1)
    assert engine.taken == sum(p.numel() * p.element_size() for p in model.model.parameters())
    assert isinstance(model.generator, Generator) and model.generator.model is model.model
    assert model.use_engine("builtin").backend is model.generator and model.engine == "builtin"
    assert model.use_engine("vllm").backend is engine and len(built) == 1  # built once, then kept


def test_the_users_names_import_from_the_root_and_from_utils_without_loading_torch_first():
    """`from hybridflow.utils import load_hf_model` (docs/api.md) and the root's re-export are the same
    objects; `import hybridflow` alone loads neither torch nor the rollout engines (a leaf import runs it)."""
    import subprocess

    import hybridflow
    from hybridflow import utils
    assert all(getattr(hybridflow, n) is getattr(utils, n) for n in ("CausalLM", "HFModel", "RewardModel",
                                                                    "load_hf_model"))
    with pytest.raises(AttributeError, match="no attribute 'load_model'"):
        hybridflow.load_model
    probe = "import sys, hybridflow.common; print('torch' in sys.modules, 'hybridflow.rollout' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
