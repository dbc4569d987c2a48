"""Multi-turn rollouts: the model talks to an environment (tools) turn by turn, and every token is kept as ids.

    loop = AgentLoop(backend, tokenizer, make_env, AgentLimits(max_turns=4, max_turn_tokens=64,
                                                               max_total_tokens=256))
    out = loop.run(prompt_ids, row_keys, params, rows)      # -> AgentOutput, B * n trajectories

A trajectory is one growing token sequence after the prompt: the model's
tokens exactly as the sampler drew them (with their log-probs), then the chat
template's glue and the environment's observation as the template's tool turn,
then the model's next turn, and so on. Nothing is decoded and encoded again:
text is decoded only to hand the environment the model's turn. The
observation is rendered once, as the difference of two `apply_chat_template`
renderings of a fixed conversation (with and without a tool turn), and that
difference is checked to tokenize as the whole rendering does (`ChatGlue`), so
a template that does not simply append turns fails loudly instead of building
a prompt the model never saw. `response_mask` is 1 on the model's tokens only:
log-probs, losses, KL and advantages skip the glue and the tool output, which
still sit in the attention (the `real` mask).

Each turn is one batched `backend.generate` call over the trajectories still
running (the built-in `Generator` or vLLM: anything with the rollout
interface), so a trajectory that ends leaves the batch, and the others do not
wait for it. A turn ends on a stop token (EOS, or a tool-call end token given
in the sampling params); a turn cut by the per-turn limit, the total budget
or `max_turns` ends the trajectory. Sampling noise is keyed by (prompt key,
sample, turn), so a trajectory is the same whichever rank or batch runs it.

On the built-in engine a run keeps its trajectories' KV cache between turns
(`turns.TurnCache`, `reuse_cache=True`, the default): turn k prefills only
what turn k-1 left out of the cache (the token sampled last, the template's
glue, the observation), not the whole trajectory again. The tokens are those
of the re-prefilling path for keyed sampling, the log-probs equal to float
rounding (tests/rollout/test_turns.py). Other engines, sliding-window models
and `reuse_cache=False` take one `generate` call per turn on the whole
trajectory (vLLM's own prefix cache then reuses the blocks it still holds).
`AgentOutput.prefill_tokens` counts what either path prefilled. Simplified on
purpose: the tool calls of one turn run one after the other on the driver of
this rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

from hybridflow.rollout.sampling import SamplingParams
from hybridflow.rollout.turns import TurnCache
from hybridflow.common import SEED_STRIDE
from hybridflow.data.prompts import adds_special_tokens, encode_prompts, left_pad, render_prompt

__all__ = ["AgentLimits", "AgentLoop", "AgentOutput", "ChatGlue", "Episode", "TemplateError", "Trajectory",
           "agent_forward", "episodes"]


class TemplateError(ValueError):
    """The chat template cannot host tool turns as appended tokens; the message says where it differs."""


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int         # model turns per trajectory
    max_turn_tokens: int   # new tokens per model turn
    max_total_tokens: int  # the whole response: model turns, glue and observations

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class ChatGlue:
    """The ids a chat template writes after a model turn and around a tool result, from its own renderings.

    end_of_turn: the id that closes an assistant turn in the template (the EOS of ChatML templates).
    """

    _BASE = [{"role": "user", "content": "1"}]
    _REPLY = {"role": "assistant", "content": "2"}

    def __init__(self, tokenizer: Any, end_of_turn: int):
        self.tokenizer, self.end_of_turn = tokenizer, end_of_turn
        prompt = self._render(self._BASE, True)
        self._closed = self._render(self._BASE + [self._REPLY], False)
        if not self._closed.startswith(prompt + self._REPLY["content"]):
            raise TemplateError("the chat template does not render an assistant turn after the generation "
                                f"prompt: {prompt!r} is not followed by the reply in {self._closed!r}")
        rest = self._closed[len(prompt) + len(self._REPLY["content"]):]
        eot = tokenizer.decode([end_of_turn], skip_special_tokens=False)
        if not rest.startswith(eot):
            raise TemplateError(f"the chat template closes an assistant turn with {rest!r}, not with the end-of-turn "
                                f"token {eot!r}")
        self.after_end = self._encode(rest[len(eot):])  # after a turn the model closed itself
        self.after_cut = self._encode(rest)             # after a turn that stopped on another stop token

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        # Template text in mid-conversation: the template writes its own special tokens, and a BOS added here
        # would sit inside the sequence (the prompt rule for template-rendered text, `data.prompts`).
        return self.tokenizer.encode(text, add_special_tokens=adds_special_tokens(chat=True))

    def tool_turn(self, observation: str) -> list[int]:
        """The tool turn holding `observation` and the next assistant header, as ids: rendered once, and
        checked to tokenize as the conversation around it does (else TemplateError)."""
        full = self._render(self._BASE + [self._REPLY, {"role": "tool", "content": observation}], True)
        if not full.startswith(self._closed):
            raise TemplateError(f"the chat template changes earlier turns when a tool turn follows: "
                                f"{self._closed!r} is not a prefix of {full!r}")
        ids = self._encode(full[len(self._closed):])
        if self._encode(self._closed) + ids != self._encode(full):
            raise TemplateError(f"the tool turn {full[len(self._closed):]!r} tokenizes differently on its own "
                                "than inside the conversation")
        return ids

    def after_turn(self, last_token: int) -> list[int]:
        return self.after_end if last_token == self.end_of_turn else self.after_cut


@dataclass
class Trajectory:
    """One row: response ids after the prompt, and per token: the model's (1) or not, log-prob, reward."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # assistant and tool turns, as the template sees them
    turns: int = 0
    ended: str = ""  # why: "env", "max_turns", "turn_tokens", "total_tokens"
    stats: dict = field(default_factory=dict)

    def add(self, ids: Sequence[int], model: bool, log_probs: Optional[Sequence[float]] = None) -> None:
        self.ids += ids
        self.mask += [int(model)] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.rewards += [0.0] * len(ids)

    @property
    def answer(self) -> str:
        """The last model turn's text."""
        turns = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return turns[-1] if turns else ""


@dataclass
class AgentOutput:
    trajectories: list[Trajectory]  # B * n, prompt-major
    prefill_tokens: int = 0  # real tokens the run prefilled, over all turns (a prompt shared by n samples once)

    def tensors(self, width: int, pad_id: int) -> dict[str, torch.Tensor]:
        """ids, mask (the model's tokens), real (every token), log_probs and rewards as [B*n, width]."""
        rows = len(self.trajectories)
        out = {"ids": torch.full((rows, width), pad_id, dtype=torch.long),
               "mask": torch.zeros(rows, width, dtype=torch.long), "real": torch.zeros(rows, width, dtype=torch.long),
               "log_probs": torch.zeros(rows, width), "rewards": torch.zeros(rows, width)}
        for i, t in enumerate(self.trajectories):
            n = len(t.ids)
            out["ids"][i, :n] = torch.tensor(t.ids, dtype=torch.long)
            out["mask"][i, :n] = torch.tensor(t.mask, dtype=torch.long)
            out["real"][i, :n] = 1
            out["log_probs"][i, :n] = torch.tensor(t.log_probs)
            out["rewards"][i, :n] = torch.tensor(t.rewards)
        return out


class AgentLoop:
    """Runs trajectories against environments made by `make_env`, one batched generate call per turn."""

    def __init__(self, backend: Any, tokenizer: Any, make_env: Callable[[], Any], limits: AgentLimits,
                 end_of_turn: Optional[int] = None, reuse_cache: bool = True):
        self.backend, self.tokenizer, self.make_env, self.limits = backend, tokenizer, make_env, limits
        # Keep the KV cache between turns where the engine is the built-in one and computes it exactly.
        self.reuse_cache = reuse_cache and TurnCache.applies(backend)
        end = tokenizer.eos_token_id if end_of_turn is None else end_of_turn
        self.glue = ChatGlue(tokenizer, end)
        self.pad_id = tokenizer.pad_token_id

    def run(self, prompt_ids: list[list[int]], row_keys: torch.Tensor, params: SamplingParams,
            rows: Sequence[dict[str, Any]]) -> AgentOutput:
        """prompt_ids: each prompt's real ids; row_keys [B]: each prompt's sampling key; rows: per prompt
        {"prompt": text, "ground_truth": ..., "extra_info": ...} for `env.reset`. B * params.n trajectories."""
        n = params.n
        trajectories = [Trajectory() for _ in range(len(prompt_ids) * n)]
        envs = []
        for i in range(len(trajectories)):
            env = self.make_env()
            row = rows[i // n]
            env.reset(row["prompt"], row.get("ground_truth"), row.get("extra_info"))
            envs.append(env)
        live = list(range(len(trajectories)))
        turns = TurnCache(self.backend) if self.reuse_cache else None
        prefilled = 0
        for turn in range(self.limits.max_turns):
            if not live:
                break
            sampled, fed = self._generate(turn, live, trajectories, prompt_ids, row_keys, params, turns)
            prefilled += fed
            for i, (tokens, log_probs, stopped) in zip(live, sampled):
                self._take_turn(trajectories[i], envs[i], tokens, log_probs, stopped, turn)
            live = [i for i in live if not trajectories[i].ended]
        for i, t in enumerate(trajectories):
            t.stats = dict(envs[i].stats()) if callable(getattr(envs[i], "stats", None)) else {}
        return AgentOutput(trajectories, prefilled)

    def _generate(self, turn: int, live: list[int], trajectories: list[Trajectory], prompt_ids, row_keys, params,
                  turns: Optional[TurnCache]):
        """One generate call for the live rows -> (per row (its tokens, log-probs, whether a stop ended it), the
        real tokens prefilled). With `turns`, only what its cache lacks of each sequence is prefilled."""
        n, limits = params.n, self.limits
        budget = {i: min(limits.max_turn_tokens, limits.max_total_tokens - len(trajectories[i].ids)) for i in live}
        steps = max(budget.values())
        if turn == 0:  # every row live: each prompt once, its n samples drawn by the engine
            first = replace(params, max_new_tokens=steps)
            fed = sum(len(p) for p in prompt_ids)
            if turns is not None:
                out = turns.first(prompt_ids, first, row_keys)
            else:
                out = self.backend.generate(*left_pad(prompt_ids, self.pad_id), first, row_keys=row_keys)
        else:
            sequences = [prompt_ids[i // n] + trajectories[i].ids for i in live]
            keys = torch.stack([(row_keys[i // n].long() * n + i % n) * SEED_STRIDE + turn for i in live])
            later = replace(params, n=1, max_new_tokens=steps)
            if turns is not None:
                before = turns.gen.prefill_tokens
                out = turns.next(live, sequences, later, keys)
                fed = turns.gen.prefill_tokens - before
            else:
                fed = sum(len(s) for s in sequences)
                out = self.backend.generate(*left_pad(sequences, self.pad_id), later, row_keys=keys)
        stops = set(params.stop_token_ids)
        result = []
        for row, i in enumerate(live):
            length = int(out.response_mask[row].sum())
            tokens = out.responses[row, :length].tolist()
            stopped = length < steps or (length > 0 and tokens[-1] in stops)
            if length > budget[i]:
                tokens, stopped = tokens[:budget[i]], False
            result.append((tokens, out.log_probs[row, :len(tokens)].tolist(), stopped))
        return result, fed

    def _take_turn(self, t: Trajectory, env: Any, tokens: list[int], log_probs: list[float], stopped: bool,
                   turn: int) -> None:
        t.add(tokens, True, log_probs)
        t.turns = turn + 1
        closed = bool(stopped and tokens and tokens[-1] == self.glue.end_of_turn)
        content = self.tokenizer.decode(tokens[:-1] if closed else tokens, skip_special_tokens=False)
        t.messages.append({"role": "assistant", "content": content})
        if not stopped:
            full = len(t.ids) >= self.limits.max_total_tokens
            t.ended = "total_tokens" if full else "turn_tokens"
            return
        observation, reward, done = env.step(content)
        if tokens:
            t.rewards[-1] += float(reward)
        if done:
            t.ended = "env"
            return
        if t.turns >= self.limits.max_turns:
            t.ended = "max_turns"
            return
        glue = self.glue.after_turn(tokens[-1] if tokens else -1) + self.glue.tool_turn(str(observation))
        if len(t.ids) + len(glue) >= self.limits.max_total_tokens:  # no room left for a model token
            t.ended = "total_tokens"
            return
        t.add(glue, False)
        t.messages.append({"role": "tool", "content": str(observation)})


@dataclass
class Episode:
    """A prompt's trajectory as a DataFlow passes it on: the response of its (prompt, response) pair."""

    answer: str  # the last model turn
    reward: float  # the environment's rewards, summed
    turns: int
    ended: str
    messages: list[dict]  # the assistant and tool turns after the prompt
    stats: dict

    def __str__(self) -> str:
        return self.answer


def _messages(item: Any) -> list[dict]:
    prompt = item["prompt"] if isinstance(item, dict) else item
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def episodes(model: Any, items: Sequence[Any], make_env: Callable[[], Any], limits: Optional[AgentLimits] = None,
             temperature: float = 0.0, n: int = 1, seed: int = 0) -> list[tuple[Any, Episode]]:
    """(item, Episode) pairs, n per item, for a generating model (`load_hf_model`'s CausalLM) and an environment.

    items: prompt strings (one user turn) or dicts {"prompt": str or chat messages, "ground_truth": ...,
    "extra_info": {...}}, the last two handed to `env.reset`. Greedy by default. Sampling is keyed by
    (seed, item position, sample, turn).
    """
    tok = model.tokenizer
    limits = limits or AgentLimits(max_turns=4, max_turn_tokens=128, max_total_tokens=512)
    chats = [_messages(item) for item in items]
    # The turns are chat-template turns (ChatGlue needs a template), so the prompt is one too: rendered by the
    # template and encoded without added special tokens, as the dataset encodes chat prompts for the trainer.
    ids = encode_prompts(tok, [render_prompt(tok, messages, chat=True) for messages in chats], chat=True)
    rows = [{"prompt": chat[-1]["content"], "ground_truth": item.get("ground_truth") if isinstance(item, dict) else None,
             "extra_info": item.get("extra_info") if isinstance(item, dict) else None} for chat, item in zip(chats, items)]
    params = model.sampling_params(limits.max_turn_tokens, temperature, n)
    loop = AgentLoop(model.backend, tok, make_env, limits)
    out = loop.run(ids, torch.arange(len(items)) + seed * SEED_STRIDE, params, rows)
    return [(items[i // n], Episode(t.answer, sum(t.rewards), t.turns, t.ended, t.messages, t.stats))
            for i, t in enumerate(out.trajectories)]


def agent_forward(make_env: Callable[[], Any], limits: Optional[AgentLimits] = None, temperature: float = 0.0,
                  n: int = 1, seed: int = 0) -> Callable[[Any, list], list]:
    """A DataFlow `forward_fn(model, items)` running `episodes` (what `Node(..., env=make_env)` uses)."""
    return lambda model, items: episodes(model, items, make_env, limits, temperature, n, seed)
