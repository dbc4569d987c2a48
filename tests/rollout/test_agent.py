"""Multi-turn rollouts (rollout/agent.py): every trajectory's ids are what the chat template renders for its
messages (checked against transformers' apply_chat_template on SmolLM2's template and on a ChatML template with
a Qwen-style tool turn), the model's tokens are kept as sampled, never re-tokenized, and limits end rows."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.data.prompts import left_pad
from hybridflow.data.tokenizer import Tokenizer, build_char_tokenizer
from hybridflow.envs import Environment
from hybridflow.models.checkpoint import load_decoder
from hybridflow.models.fetch import FetchError, fetch_model
from hybridflow.rollout import Generator, SamplingParams
from hybridflow.rollout.agent import AgentLimits, AgentLoop, ChatGlue, TemplateError, Trajectory
from tests.rollout.conftest import tiny_decoder

REPO = Path(__file__).resolve().parents[2]

# Qwen2.5's way of showing a tool result: inside a user turn, between tags (not a turn named after its role).
QWEN_STYLE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PROMPTS = ["What is 123 * 45? Use the calculator.", "Name three colours, then ask the tool.",
           "Say hello."]


class Scripted(Environment):
    """Answers every turn with an observation chosen to be awkward for tokenizers (leading spaces, digits
    that merge, a newline, non-ASCII), until `turns` turns; reward 1 on the last one."""

    OBSERVATIONS = (" 5535", "error: the call is not JSON (Expecting value)\n", "naïve → 12.50")

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, prompt, ground_truth=None, extra_info=None):
        self.seen = 0

    def step(self, model_turn):
        self.seen += 1
        done = self.seen >= self.turns
        return self.OBSERVATIONS[(self.seen - 1) % 3], float(done), done


@pytest.fixture(scope="module")
def smollm2():
    try:
        return fetch_model("smollm2", log=lambda _: None)
    except (FetchError, OSError) as exc:
        pytest.skip(f"SmolLM2-135M-Instruct is not here and could not be fetched (`hybridflow fetch-model "
                    f"smollm2`): {exc}")


def chatml_copy(model_dir, tmp_path):
    """SmolLM2's vocabulary with the Qwen-style template in its tokenizer_config.json."""
    out = tmp_path / "chatml"
    out.mkdir()
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_STYLE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def run_loop(model, tok, limits, n=2, temperature=1.0, turns=3, stops=None):
    gen = Generator(model, pad_token_id=tok.pad_token_id, tokenizer=tok)
    prompts = [tok.encode(tok.render_prompt([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    params = SamplingParams(max_new_tokens=limits.max_turn_tokens, temperature=temperature, n=n,
                            stop_token_ids=stops or (tok.eos_token_id,))
    loop = AgentLoop(gen, tok, lambda: Scripted(turns), limits)
    out = loop.run(prompts, torch.tensor([11, 22, 33]), params, [{"prompt": p} for p in PROMPTS])
    return prompts, loop, out


def canonical(tok, t: Trajectory) -> bool:
    """Whether every model turn's ids are what the tokenizer makes of their text (then, and only then, the
    whole trajectory must equal a tokenization of the rendered messages)."""
    spans, start = [], None
    for j, m in enumerate(t.mask + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            spans.append(t.ids[start:j])
            start = None
    eos = tok.eos_token_id
    return all(tok.encode(tok.decode(s[:-1] if s[-1] == eos else s, skip_special_tokens=False),
                          add_special_tokens=False) == (s[:-1] if s[-1] == eos else s) for s in spans)


def check_against_transformers(directory, prompts, loop, out, n):
    """ids == transformers' apply_chat_template(messages) for every trajectory whose model turns are canonical;
    the text equals its rendering for all. Returns how many were checked id for id."""
    tok, reference = loop.tokenizer, AutoTokenizer.from_pretrained(str(directory))
    exact = 0
    for i, t in enumerate(out.trajectories):
        messages = [{"role": "user", "content": PROMPTS[i // n]}] + t.messages
        ref = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)["input_ids"]
        ours = prompts[i // n] + t.ids
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        assert text.startswith(tok.decode(ours, skip_special_tokens=False)), (i, text)
        if canonical(tok, t):
            assert ref[:len(ours)] == ours, (i, messages)
            closed = t.ids[-1] == tok.eos_token_id and t.mask[-1] == 1
            assert ref[len(ours):] == (loop.glue.after_end if closed else [tok.eos_token_id] + loop.glue.after_end)
            exact += 1
    return exact


@pytest.mark.parametrize("template", ["smollm2", "qwen-style chatml"])
def test_trajectories_equal_the_chat_template(smollm2, tmp_path, template):
    """A small random model that writes whole words (so its turns are canonical token sequences) over
    SmolLM2's vocabulary, under SmolLM2's own template and under a ChatML template with Qwen's tool turn."""
    directory = smollm2 if template == "smollm2" else chatml_copy(smollm2, tmp_path)
    tok = Tokenizer.from_path(directory)
    model = boosted_model(tok, [" the", " cat", " sat", " on", " a", " mat", " and", " tool", ",", ".", "!"])
    stops = (tok.eos_token_id, tok.token_to_id("."), tok.token_to_id("!"))
    limits = AgentLimits(max_turns=3, max_turn_tokens=10, max_total_tokens=120)
    prompts, loop, out = run_loop(model, tok, limits, stops=stops)
    assert sum(1 for t in out.trajectories if t.turns == 3) >= 2  # multi-turn rows are what is checked
    exact = check_against_transformers(directory, prompts, loop, out, n=2)
    assert exact >= 4, f"only {exact} of 6 trajectories had canonical model turns to compare id for id"
    check_masks(out)


@pytest.mark.slow
def test_smollm2_trajectories_equal_the_chat_template(smollm2):
    """The same check on trajectories SmolLM2-135M-Instruct itself samples."""
    tok = Tokenizer.from_path(smollm2)
    stops = (tok.eos_token_id,) + tuple(tok.token_to_id(p) for p in (".", "!", "?"))
    limits = AgentLimits(max_turns=3, max_turn_tokens=10, max_total_tokens=120)
    prompts, loop, out = run_loop(load_decoder(smollm2).eval(), tok, limits, n=1, stops=stops)
    assert any(t.turns > 1 for t in out.trajectories)
    assert check_against_transformers(smollm2, prompts, loop, out, n=1) >= 2
    check_masks(out)


def check_masks(out) -> None:
    """The mask is 1 exactly on the model's tokens, which carry their sampled log-probs (<= 0); 0 elsewhere."""
    assert any(lp < 0 for t in out.trajectories for lp in t.log_probs)
    for t in out.trajectories:
        assert all(lp <= 0 for lp, m in zip(t.log_probs, t.mask) if m)
        assert all(lp == 0 for lp, m in zip(t.log_probs, t.mask) if not m)
        assert [m["role"] for m in t.messages][::2] == ["assistant"] * t.turns


def test_model_tokens_are_kept_as_sampled_never_re_tokenized(smollm2):
    """A random model over SmolLM2's vocabulary samples token sequences the tokenizer would never make of
    their text; the trajectory keeps them, and its glue and observations are still the template's ids."""
    tok = Tokenizer.from_path(smollm2)
    model = letters_model(tok)
    # Turns end on many ids (every 5th) other than the end of turn: the template's closing glue follows them.
    stops = tuple(range(0, tok.vocab_size, 5)) + (tok.eos_token_id,)
    limits = AgentLimits(max_turns=3, max_turn_tokens=6, max_total_tokens=80)
    prompts, loop, out = run_loop(model, tok, limits, stops=stops)
    assert any(not canonical(tok, t) for t in out.trajectories), "no non-canonical turn: nothing shown"
    assert any(t.turns > 1 for t in out.trajectories)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, stop_token_ids=stops)
    first = loop.backend.generate(*left_pad(prompts, tok.pad_token_id), params, row_keys=torch.tensor([11, 22, 33]))
    reference = AutoTokenizer.from_pretrained(str(smollm2))
    for i, t in enumerate(out.trajectories):
        sampled = first.responses[i, :int(first.response_mask[i].sum())].tolist()
        assert t.ids[:len(sampled)] == sampled and t.mask[:len(sampled)] == [1] * len(sampled)
        assert rebuilt(loop, t) == t.ids
        messages = [{"role": "user", "content": PROMPTS[i // 2]}] + t.messages
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        assert text.startswith(tok.decode(prompts[i // 2] + t.ids, skip_special_tokens=False))


def boosted_model(tok, pieces, scale=40.0):
    """A tiny random decoder whose samples are nearly all among `pieces` (their output rows scaled up)."""
    model = tiny_decoder("llama-gqa", vocab_size=tok.vocab_size)
    ids = [tok.encode(p, add_special_tokens=False) for p in pieces]
    assert all(len(i) == 1 for i in ids), "each piece must be one token"
    with torch.no_grad():
        model.lm_head.weight[[i[0] for i in ids]] *= scale
    return model


def letters_model(tok):
    """Samples nearly all single letters: "t", "h", "e" sampled one by one are ids the tokenizer would merge
    ("the"), so its turns are not what their text tokenizes to."""
    return boosted_model(tok, list("abcdefghijklmnopqrstuvwxyz"))


def rebuilt(loop, t: Trajectory) -> list[int]:
    """The trajectory from its model spans and its tool messages rendered by the template's glue."""
    ids, k = [], 0
    for message in t.messages:
        if message["role"] == "assistant":
            while k < len(t.ids) and t.mask[k]:
                ids.append(t.ids[k])
                k += 1
        else:
            glue = loop.glue.after_turn(ids[-1]) + loop.glue.tool_turn(message["content"])
            ids += glue
            k += len(glue)
    return ids


def test_chat_glue_is_the_difference_of_two_renderings(smollm2):
    tok = Tokenizer.from_path(smollm2)
    glue = ChatGlue(tok, tok.eos_token_id)
    assert tok.decode(glue.after_end, skip_special_tokens=False) == "\n"
    assert tok.decode(glue.tool_turn(" 42"), skip_special_tokens=False) == \
        "<|im_start|>tool\n 42<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(glue.after_cut, skip_special_tokens=False) == "<|im_end|>\n"


def test_templates_that_do_not_append_turns_are_refused(smollm2, tmp_path):
    out = chatml_copy(smollm2, tmp_path)
    config = json.loads((out / "tokenizer_config.json").read_text())
    # Drops every assistant turn but the last, as templates that strip earlier reasoning do.
    config["chat_template"] = (
        "{%- for m in messages %}{%- if m['role'] != 'assistant' or loop.last %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_path(out)
    with pytest.raises(TemplateError, match="changes earlier turns"):
        ChatGlue(tok, tok.eos_token_id).tool_turn("42")


def test_limits_end_trajectories(smollm2):
    tok = Tokenizer.from_path(smollm2)
    stops = (tok.eos_token_id, tok.token_to_id("."))
    words = boosted_model(tok, [" the", " cat", " on", " a"])  # no stop: every turn runs into the turn limit
    _, _, out = run_loop(words, tok, AgentLimits(max_turns=4, max_turn_tokens=3, max_total_tokens=100), n=1)
    assert [(t.turns, t.ended, t.mask) for t in out.trajectories] == [(1, "turn_tokens", [1, 1, 1])] * 3
    sentences = boosted_model(tok, [" the", " cat", " on", " a", "."])  # turns end on "."
    _, _, out = run_loop(sentences, tok, AgentLimits(max_turns=2, max_turn_tokens=12, max_total_tokens=100), n=1,
                         turns=5, stops=stops)
    assert [(t.turns, t.ended) for t in out.trajectories] == [(2, "max_turns")] * 3
    _, loop, out = run_loop(sentences, tok, AgentLimits(max_turns=4, max_turn_tokens=10, max_total_tokens=30), n=1,
                            turns=5, stops=stops)
    for t in out.trajectories:  # the second tool turn does not fit: the row ends before it, nothing cut
        assert t.ended == "total_tokens" and len(t.ids) <= 30 and t.mask[-1] == 1
        assert len(t.ids) + len(loop.glue.after_turn(t.ids[-1]) + loop.glue.tool_turn(Scripted.OBSERVATIONS[1])) >= 30


def test_agent_flow_example_runs_episodes_through_a_dataflow(smollm2, tmp_path, capsys):
    """examples/agent_flow.py: Node(name="rollout", model=..., env=make_calculator_env) -> reward node, on a
    tiny model with SmolLM2's vocabulary and template (it answers in words: one turn, no call, reward 0), and
    the same flow with limits of its own; a Node given both env and forward_fn is refused."""
    import importlib.util

    from hybridflow import Node
    from hybridflow.envs import make_calculator_env
    from hybridflow.models import save_decoder

    tok = Tokenizer.from_path(smollm2)
    model_dir = save_decoder(boosted_model(tok, [" the", " cat", " on", "."]), tmp_path / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, model_dir / name)
    spec = importlib.util.spec_from_file_location("agent_flow", REPO / "examples" / "agent_flow.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    table = example.main(["--model", str(model_dir), "--prompts", "['What is 12 * 34?', 'And 5 * 6?']",
                          "--truths", "['408', '30']", "--max-turns", "2", "--max-turn-tokens", "6"])
    row = table[str(model_dir)]
    assert row == {"accuracy": 0.0, "well_formed_call": 0.0, "malformed_call": 0.0, "turns": 1.0}
    printed = capsys.readouterr().out
    assert "[Rollout] " in printed and "--- What is 12 * 34?" in printed
    flow = example.build_flow(str(model_dir))  # Node(env=...): the default limits
    result = flow.run(["What is 2 * 3?"])
    (item, episode), = result.outputs["rollout"]
    assert item == "What is 2 * 3?" and result.final == [episode.reward] and episode.messages[0]["role"] == "assistant"
    with pytest.raises(ValueError, match="give env .* or forward_fn, not both"):
        Node(name="rollout", forward_fn=lambda m, x: x, env=make_calculator_env)


# A Llama-style template that writes BOS itself; the assistant turn ends on EOS.
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")


def test_glue_takes_no_bos_from_a_tokenizer_that_adds_one(tmp_path):
    """The glue after a model turn is template text mid-sequence, encoded by the rule for template-rendered
    prompts (no added special tokens): a BOS added to it would sit inside the trajectory, and the tool turn
    would not tokenize as the whole conversation does."""
    out = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789:\n", tmp_path / "tok", add_bos_token=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": BOS_TEMPLATE}))
    tok = Tokenizer.from_path(out)
    assert tok.encode("a")[0] == tok.bos_token_id  # this tokenizer adds BOS unless told not to
    glue = ChatGlue(tok, tok.eos_token_id)
    assert glue.after_end == tok.encode("\n", add_special_tokens=False)
    assert glue.after_cut == tok.encode("<eos>\n", add_special_tokens=False)
    assert glue.tool_turn("42") == tok.encode("tool:42\nassistant:", add_special_tokens=False)
