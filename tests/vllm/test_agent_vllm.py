"""The multi-turn agent loop (rollout/agent.py) on the vLLM backend (`make test-vllm`): it calls only the rollout
interface, so vLLM serves it as the built-in engine does; greedy trajectories are the same ids, masks and
(within the backends' log-prob tolerance) log-probs on both."""
import shutil

import pytest
import torch

from hybridflow.data.tokenizer import Tokenizer
from hybridflow.models import Decoder, DecoderConfig, save_decoder
from hybridflow.models.fetch import FetchError, fetch_model
from hybridflow.rollout import Generator, SamplingParams, hf_named
from hybridflow.rollout.agent import AgentLimits, AgentLoop
from tests.rollout.test_agent import PROMPTS, Scripted

vllm = pytest.importorskip("vllm", reason="the vLLM backend's tests run under `make test-vllm`")
from hybridflow.rollout.vllm_backend import VLLMBackend  # noqa: E402


def test_agent_loop_on_vllm_equals_the_builtin_engine(tmp_path):
    try:
        smollm2 = fetch_model("smollm2", log=lambda _: None)
    except (FetchError, OSError) as exc:
        pytest.skip(f"SmolLM2's tokenizer is not here and could not be fetched: {exc}")
    tok = Tokenizer.from_path(smollm2)
    cfg = DecoderConfig.from_hf_dict(dict(model_type="llama", vocab_size=tok.vocab_size, hidden_size=256,
                                          intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=64, max_position_embeddings=512))
    model = Decoder(cfg).init_weights(std=0.15, seed=0).eval()
    words = [tok.encode(w, add_special_tokens=False)[0] for w in (" the", " cat", " on", " a", ".")]
    with torch.no_grad():  # a model that writes a few words and ends turns on "."
        model.lm_head.weight[words] *= 20.0
    path = save_decoder(model, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, path / name)
    engine = VLLMBackend(str(path), tok, dtype="float32", max_model_len=256)
    engine.load_weights(hf_named(model))
    prompts = [tok.encode(tok.render_prompt([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, do_sample=False,
                            stop_token_ids=(tok.eos_token_id, tok.token_to_id(".")))
    runs = {}
    for name, backend in (("builtin", Generator(model, tok.pad_token_id, tok)), ("vllm", engine)):
        loop = AgentLoop(backend, tok, lambda: Scripted(3), AgentLimits(3, 8, 120))
        runs[name] = loop.run(prompts, torch.tensor([1, 2, 3]), params, [{"prompt": p} for p in PROMPTS])
    assert any(t.turns == 3 for t in runs["builtin"].trajectories)
    for ours, theirs in zip(runs["builtin"].trajectories, runs["vllm"].trajectories):
        assert (ours.ids, ours.mask, ours.turns, ours.ended) == (theirs.ids, theirs.mask, theirs.turns, theirs.ended)
        # 1e-3, not the 1e-4 of test_engine.py: the boosted output rows make logits ~20x larger, and their
        # rounding with them (measured: at most 2.6e-4).
        torch.testing.assert_close(torch.tensor(theirs.log_probs), torch.tensor(ours.log_probs), atol=1e-3, rtol=0)
