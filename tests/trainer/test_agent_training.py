"""GRPO and PPO over multi-turn trajectories (issue 34, item 3): the trainer scores the tokens the sampler
produced, at their places between tool turns; the environment's rewards reach the advantages; two Ray
processes take the one-process steps.

The model is a tiny random decoder over a character vocabulary with ChatML's special tokens and a chat
template with a tool turn, so nothing is fetched; the environment answers every turn (the random model
never writes a tool call), which is what makes the trajectories multi-turn.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.config.loader import load_config
from hybridflow.data import fields as F
from hybridflow.data.arithmetic import generate_tool_splits, write_parquet
from hybridflow.data.tokenizer import build_char_tokenizer
from hybridflow.models import Decoder, DecoderConfig, save_decoder
from hybridflow.trainer import read_metrics
from hybridflow.trainer.trainer import RLTrainer

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Turns end on any letter besides EOS (which a random model rarely writes): short turns, nearly all closed.
STOP_ON_LETTERS = f"env.stop_tokens=[{','.join('abcdefghijklmnopqrstuvwxyz')}]"
ENV = '''
from hybridflow.envs import Environment

class Echo(Environment):
    """Answers two turns with an observation; the reward: distinct characters of the last turn, over 10."""
    def reset(self, prompt, ground_truth=None, extra_info=None):
        self.turns = 0
    def step(self, turn):
        self.turns += 1
        done = self.turns == 2
        return "result: 42", (len(set(turn)) / 10 if done else 0.05), done
    def stats(self):
        return {"answered": self.turns}

def make_env():
    return Echo()
'''


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    """(model dir, data file, env spec) of the tiny multi-turn run."""
    root = tmp_path_factory.mktemp("agent")
    tok_dir = build_char_tokenizer("0123456789abcdefghijklmnopqrstuvwxyz*?.:,=_ <>{}\"/\nWCYIT", root / "tok",
                                   eos="<|im_end|>", bos="<|im_start|>", pad="<|endoftext|>")
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = DecoderConfig.from_hf_dict(dict(model_type="llama", vocab_size=len(vocab), hidden_size=32,
                                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=512))
    # Weights large enough that the context moves the next-token distribution (what the log-prob check sees).
    model_dir = save_decoder(Decoder(cfg).init_weights(std=0.5, seed=0), root / "model")  # writes the directory
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    train, _ = generate_tool_splits(16, 0, seed=0)
    for row in train:  # the question only: the system message and worked example are not what is tested
        row["prompt"] = row["prompt"][-1:]
        row["prompt"][0]["content"] = row["prompt"][0]["content"].lower()
    data = write_parquet(train, root / "train.parquet")
    (root / "echo_env.py").write_text(ENV)
    return model_dir, data, f"{root / 'echo_env.py'}:make_env"


def agent_config(agent_run, tmp_path, name="tiny-grpo.yaml", *overrides):
    model_dir, data, env = agent_run
    return load_config(ROOT / "configs" / name, [
        f"trainer.output_dir={tmp_path}", f"model.path={model_dir}", f"data.train_files=[{data}]", "data.val_files=[]",
        "data.apply_chat_template=true", "data.max_prompt_length=48", "data.max_response_length=64",
        f"env.function={env}", "env.max_turns=3", "env.max_turn_tokens=8", STOP_ON_LETTERS,
        "reward.function=arithmetic_chat",
        "reward.rule_weight=0", "trainer.save_every=0", *overrides])


def holes(mask: torch.Tensor) -> torch.Tensor:
    """Rows whose response mask has a 0 between two 1s (tool tokens inside the response)."""
    m = mask.bool()
    after_first = m.long().cumsum(-1) > 0
    before_last = m.flip(-1).long().cumsum(-1).flip(-1) > 0
    return (~m & after_first & before_last).any(-1)


@pytest.mark.parametrize("packed", [False, True])
def test_grpo_scores_the_sampled_tokens_between_tool_turns(agent_run, tmp_path, packed):
    """The actor's recomputed log-probs of the model's tokens equal the sampler's (so the trainer sees the
    sequence the sampler saw, tool tokens attended to), and the environment's reward is the score. Packed:
    the log-prob pass packs each row's real tokens (ATTENTION_MASK) back to back."""
    trainer = RLTrainer(agent_config(agent_run, tmp_path, "tiny-grpo.yaml", "actor.skip_old_log_probs=false",
                                     "trainer.launcher=local", f"actor.log_prob_use_dynamic_bsz={packed}",
                                     "actor.log_prob_max_token_len_per_gpu=512"))
    try:
        batch, metrics, _ = trainer.prepare(1)
        mask = batch[F.RESPONSE_MASK].bool()
        assert holes(mask).all()  # every row: model turn, tool turn, model turn
        real = batch[F.ATTENTION_MASK][:, -mask.shape[1]:].bool()
        assert (real >= mask).all() and (real & ~mask).any()
        torch.testing.assert_close(batch[F.OLD_LOG_PROBS][mask], batch[F.ROLLOUT_LOG_PROBS][mask],
                                   atol=2e-4, rtol=0)
        torch.testing.assert_close(batch[F.SCORES], batch[F.ENV_REWARDS].sum(-1))
        # Each trajectory's turns (model-token runs in the mask) and the environment's counts reach the metrics.
        runs = (mask & ~torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1)).sum(-1)
        assert [s["turns"] for s in batch[F.ENV_STATS]] == runs.tolist()
        assert metrics["env/turns_mean"] == pytest.approx(runs.float().mean().item())
        assert metrics["env/answered_mean"] == pytest.approx(
            sum(s["answered"] for s in batch[F.ENV_STATS]) / len(runs))
        assert sum(v for k, v in metrics.items() if k.startswith("env/ended_")) == pytest.approx(1.0)
        # Per-turn rewards sit on the last token of the turn they answer, never on a tool token.
        assert (batch[F.TOKEN_SCORES][~mask] == 0).all()
        turn_ends = mask & ~torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
        assert ((batch[F.TOKEN_SCORES] != 0) <= turn_ends).all()
        assert (batch[F.ADVANTAGES][~mask] == 0).all() and (batch[F.ADVANTAGES][mask] != 0).any()
        stats = trainer.update(batch, 1)
        assert stats["actor/grad_norm"] > 0
    finally:
        trainer.shutdown()


def test_ppo_gae_carries_values_across_tool_turns(agent_run, tmp_path):
    """PPO with a critic and GAE: advantages and returns are 0 on tool tokens, the per-turn rewards of the
    first turn reach its tokens, and the update runs."""
    trainer = RLTrainer(agent_config(agent_run, tmp_path, "tiny-ppo.yaml", "trainer.launcher=local",
                                     "algorithm.use_kl_in_reward=false", "reference.enabled=false",
                                     "actor.use_kl_loss=false"))
    try:
        batch, _, _ = trainer.prepare(1)
        mask = batch[F.RESPONSE_MASK].bool()
        assert holes(mask).all()
        for name in (F.ADVANTAGES, F.RETURNS, F.VALUES):
            assert (batch[name][~mask] == 0).all(), name
        first_turn = mask & (mask.long().cumsum(-1) <= 8) & ~holes_after(mask)
        assert (batch[F.RETURNS][first_turn] != 0).all()
        stats = trainer.update(batch, 1)
        assert stats["critic/vf_loss"] >= 0 and stats["actor/grad_norm"] > 0
    finally:
        trainer.shutdown()


def holes_after(mask: torch.Tensor) -> torch.Tensor:
    """Positions after the first tool token of each row."""
    first_gap = (~mask & (mask.long().cumsum(-1) > 0)).long().cumsum(-1) > 0
    return first_gap


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
def test_two_ray_processes_take_the_one_process_steps(agent_run, tmp_path):
    """GRPO over multi-turn trajectories at DP2 on two Ray processes equals the one-process run, two steps."""
    from tests.trainer.test_trainer import learned

    records = {}
    for name, extra in (("one", ["trainer.launcher=local"]), ("two", ["trainer.n_devices=2", "trainer.launcher=ray"])):
        cfg = agent_config(agent_run, tmp_path / name, "tiny-grpo.yaml", "trainer.total_steps=2", "trainer.val_every=0",
                           "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", *extra)
        trainer = RLTrainer(cfg)
        try:
            summary = trainer.fit()
        finally:
            trainer.shutdown()
        records[name] = learned(read_metrics(summary["run_dir"] / "metrics.jsonl"))
    one, two = records["one"], records["two"]
    for step in (1, 2):
        assert two[step].keys() == one[step].keys()
        for key, value in one[step].items():
            assert two[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


def test_outcome_score_lands_on_the_last_model_token():
    """A rule or reward-model score goes on the last token the model wrote, past the tool tokens between
    its turns (not at the count of model tokens minus one, which is inside the trajectory)."""
    from hybridflow.roles.preparation import token_scores

    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0], [0] * 8])
    out = token_scores(torch.tensor([2.0, 3.0, 5.0]), mask)
    expected = torch.zeros(3, 8)
    expected[0, 6], expected[1, 2] = 2.0, 3.0
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("override, key, message", [
    ("env.function=calculater", "env.function", "did you mean 'calculator'"),
    ("env.max_turn_tokens=65", "env.max_turn_tokens", r"must be in \[1, data.max_response_length = 64\]"),
    ("env.max_turns=0", "env.max_turns", "must be >= 1"),
    ("data.apply_chat_template=false", "data.apply_chat_template", "env.function needs the chat template"),
    ("env.stop_tokens=[ab]", "env.stop_tokens", "'ab' is not one token of the vocabulary"),
])
def test_bad_env_settings_are_named(agent_run, tmp_path, override, key, message):
    from hybridflow.errors import ConfigError
    from hybridflow.controller.worker import WorkerError

    with pytest.raises((ConfigError, WorkerError), match=message) as caught:
        trainer = RLTrainer(agent_config(agent_run, tmp_path, "tiny-grpo.yaml", "trainer.launcher=local", override))
        trainer.shutdown()
    assert key in str(caught.value)


def test_validation_reports_the_episodes(agent_run, tmp_path):
    """Validation of a multi-turn run logs the episodes' turns, the environment's counts and why they ended."""
    _, data, _ = agent_run
    trainer = RLTrainer(agent_config(agent_run, tmp_path, "tiny-grpo.yaml", f"data.val_files=[{data}]",
                                     "data.val_max_samples=4", "trainer.launcher=local"))
    try:
        metrics = trainer.validate()
    finally:
        trainer.shutdown()
    assert metrics["val/n"] == 4
    assert 1 <= metrics["val/env/turns_mean"] <= 3 and 0 <= metrics["val/env/answered_rate"] <= 1
    assert sum(v for k, v in metrics.items() if k.startswith("val/env/ended_")) == pytest.approx(1.0)
