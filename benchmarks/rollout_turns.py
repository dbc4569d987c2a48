"""`bench rollout`'s multi-turn case: an agent loop's episodes with the KV cache kept between turns
(`rollout/turns.py`) against re-prefilling the whole trajectory at every turn, side by side in one run.

The episodes: B prompts x n samples on the benchmark's random Llama-shaped model, a character tokenizer
over its whole vocabulary with a ChatML-like template (an assistant turn ends on EOS; a tool turn is
"tool:<observation>\\n" and the next assistant header), and an environment that answers every turn with a
fixed-length observation and ends the episode after `turns` turns. A model turn ends on any of
vocab/`stop_every` stop ids (near-uniform logits: about `stop_every` tokens a turn), cut at `turn_tokens`.
Both paths sample with the same keys, so they make the same episodes (`same`: the share of episodes whose
ids are equal).

Reported per episode: prefill tokens (real tokens the prefill computed, a prompt shared by its n samples
counted once and divided over them) and prefill positions (what the forward passes ran: the C++ prefill
skips left padding, `forward_cached`, which prefills a kept cache's new tokens, computes it too), and
episode tokens/s (every token of the episodes after their prompts, model, glue and observations, over the
wall time of the loop; median of the repeats, the two paths alternating, and the best repeat's, which a
loaded machine disturbs least).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridflow.data.tokenizer import Tokenizer, build_char_tokenizer
from hybridflow.envs import Environment
from hybridflow.models import Decoder
from hybridflow.rollout import Generator, SamplingParams
from hybridflow.rollout.agent import AgentLimits, AgentLoop

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
_ASCII = "abcdefghijklmnopqrstuvwxyz0123456789:= \n"


def char_tokenizer(vocab: int, directory: Path) -> Tokenizer:
    """A character tokenizer with exactly `vocab` ids (4 specials, ASCII, then other code points)."""
    others = (chr(c) for c in range(0x100, 0x100 + vocab) if not chr(c).isspace())
    chars = _ASCII + "".join(next(others) for _ in range(vocab - 4 - len(_ASCII)))
    out = build_char_tokenizer(chars, directory)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return Tokenizer.from_path(out)


class FixedTurns(Environment):
    """Every turn answered with an `obs_len`-character observation; done after `turns` turns."""

    def __init__(self, turns: int, obs_len: int):
        self.turns, self.obs = turns, ("result " + "7" * obs_len)[:obs_len]

    def reset(self, prompt, ground_truth=None, extra_info=None):
        self.k = 0

    def step(self, model_turn):
        self.k += 1
        return self.obs, float(self.k >= self.turns), self.k >= self.turns


def bench_turns(model: Decoder, prompts: int, n: int, prompt_len: int, turns: int, turn_tokens: int,
                obs_len: int, stop_every: int, repeats: int) -> dict:
    """Both paths' figures on the same episodes (see the module doc)."""
    vocab = model.cfg.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        tok = char_tokenizer(vocab, Path(tmp))
    g = torch.Generator().manual_seed(0)
    letters = _ASCII[:26]
    texts = ["".join(letters[int(i)] for i in torch.randint(0, 26, (prompt_len,), generator=g))
             for _ in range(prompts)]
    prompt_ids = [tok.encode(tok.render_prompt([{"role": "user", "content": t}]), add_special_tokens=False)
                  for t in texts]
    stops = tuple(range(4 + len(_ASCII), vocab, stop_every)) + (tok.eos_token_id,)
    params = SamplingParams(max_new_tokens=turn_tokens, temperature=1.0, n=n, stop_token_ids=stops)
    limits = AgentLimits(max_turns=turns, max_turn_tokens=turn_tokens, max_total_tokens=turns * (turn_tokens + obs_len + 32))
    rows = [{"prompt": t} for t in texts]
    paths = {"re-prefill": False, "kept cache": True}
    seconds = {name: [] for name in paths}
    result = {}
    for i in range(repeats + 1):  # round 0 warms up (the C++ extension, allocator)
        for name, reuse in paths.items():
            gen = Generator(model, pad_token_id=tok.pad_token_id, tokenizer=tok)
            loop = AgentLoop(gen, tok, lambda: FixedTurns(turns, obs_len), limits, reuse_cache=reuse)
            start = time.perf_counter()
            out = loop.run(prompt_ids, torch.arange(prompts) + 7, params, rows)
            if i:
                seconds[name].append(time.perf_counter() - start)
            result[name] = (out, gen.prefill_positions)
    episodes = prompts * n
    figures = {}
    for name in paths:
        out, positions = result[name]
        tokens = sum(len(t.ids) for t in out.trajectories)
        wall = statistics.median(seconds[name])
        figures[name] = {"prefill_tokens": out.prefill_tokens / episodes, "prefill_positions": positions / episodes,
                         "episode_tokens_per_s": tokens / wall, "wall_s": wall,
                         "best_tokens_per_s": tokens / min(seconds[name]),
                         "turns_mean": sum(t.turns for t in out.trajectories) / episodes}
    again, kept = (result[name][0].trajectories for name in paths)
    same = sum(a.ids == b.ids for a, b in zip(again, kept)) / episodes
    return {"workload": "turns", "prompts": prompts, "n": n, "prompt_len": len(prompt_ids[0]), "turns": turns,
            "turn_tokens": turn_tokens, "obs_len": obs_len, "paths": figures, "same": same,
            "prefill_ratio": figures["kept cache"]["prefill_tokens"] / figures["re-prefill"]["prefill_tokens"],
            "positions_ratio": figures["kept cache"]["prefill_positions"] / figures["re-prefill"]["prefill_positions"],
            "speedup": figures["kept cache"]["episode_tokens_per_s"] / figures["re-prefill"]["episode_tokens_per_s"],
            "best_speedup": figures["kept cache"]["best_tokens_per_s"] / figures["re-prefill"]["best_tokens_per_s"]}


def print_turns(row: dict) -> None:
    print(f"multi-turn agent episodes: {row['prompts']} prompts x {row['n']}, prompt {row['prompt_len']} tokens, "
          f"{row['turns']} turns of <= {row['turn_tokens']} tokens, observations of {row['obs_len']} characters")
    print(f"{'path':>11s} {'prefill tok/ep':>15s} {'positions/ep':>13s} {'turns/ep':>9s} {'episode tok/s':>14s} "
          f"{'best tok/s':>11s}")
    for name, f in row["paths"].items():
        print(f"{name:>11s} {f['prefill_tokens']:15.1f} {f['prefill_positions']:13.1f} {f['turns_mean']:9.2f} "
              f"{f['episode_tokens_per_s']:14.0f} {f['best_tokens_per_s']:11.0f}")
    print(f"kept / re-prefill: prefill tokens {row['prefill_ratio']:.3f}x, positions {row['positions_ratio']:.3f}x, "
          f"episode tok/s {row['speedup']:.2f}x (median), {row['best_speedup']:.2f}x (best); "
          f"same episodes {row['same']:.0%}")
