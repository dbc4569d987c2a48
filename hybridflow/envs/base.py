"""`Environment` and `ToolEnv`: what answers a model's turn in a multi-turn rollout.

    env = make_env()                       # one instance per trajectory (the agent loop calls the factory)
    env.reset(prompt, ground_truth, extra_info)
    observation, reward, done = env.step(model_turn_text)

The agent loop (`hybridflow/rollout/agent.py`) renders `observation` as the
chat template's tool turn and samples the model's next turn after it, until
`done`, the turn limit or the token budget. `reward` is placed on the last
token of the turn it answers, so GAE-style estimators see per-turn rewards and
outcome estimators (GRPO) see their sum.

`ToolEnv` is the tool-calling environment most tasks need: a turn that holds
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format
Qwen2.5 and SmolLM3 templates use) runs the tool and answers with its output;
a turn without one is the final answer, scored by `score(answer, ground_truth)`.
A malformed call (bad JSON, unknown tool, no closing tag) is answered with an
error observation and counted; the episode goes on.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from hybridflow.envs.tools import Tool

__all__ = ["CALL_CLOSE", "CALL_OPEN", "Environment", "ToolEnv", "parse_tool_call"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(" + re.escape(CALL_CLOSE) + r"|$)", re.S)

Step = tuple[Optional[str], float, bool]


class Environment:
    """One episode per instance. Subclasses implement `reset` and `step`; `stats` is optional."""

    def reset(self, prompt: str, ground_truth: Any = None, extra_info: Optional[dict] = None) -> None:
        raise NotImplementedError

    def step(self, model_turn: str) -> Step:
        """The model's turn (its text) -> (observation for the next turn or None, reward, done)."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Per-episode counts the rollout reports (e.g. tool calls made); empty by default."""
        return {}


def parse_tool_call(text: str, tools: dict[str, Tool]) -> tuple[Optional[Tool], Any, Optional[str]]:
    """The first call in `text`: (tool, arguments, None), or (None, None, why it is malformed)."""
    match = _CALL.search(text)
    if match is None:
        return None, None, "no tool call"
    if not match.group(2):
        return None, None, f"the call has no closing {CALL_CLOSE}"
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as exc:
        return None, None, f"the call is not JSON ({exc.msg})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, None, 'a call is {"name": ..., "arguments": {...}}'
    tool = tools.get(call["name"])
    if tool is None:
        return None, None, f"unknown tool {call['name']!r}; tools: {sorted(tools)}"
    return tool, call.get("arguments", {}), None


@dataclass
class ToolEnv(Environment):
    """Tool calls until a turn without one, which is the answer.

    score(answer_text, ground_truth) -> reward of the final turn; call_reward: the reward of each
    well-formed call (0: outcome reward only); max_calls: calls (well-formed or not) before the
    episode ends unanswered (reward 0).
    """

    tools: Sequence[Tool]
    score: Callable[[str, Any], float]
    call_reward: float = 0.0
    max_calls: int = 4
    _by_name: dict[str, Tool] = field(init=False, repr=False)
    _truth: Any = field(default=None, init=False, repr=False)
    _counts: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {t.name: t for t in self.tools}
        if len(self._by_name) != len(self.tools):
            raise ValueError(f"tool names must be distinct, got {[t.name for t in self.tools]}")

    def reset(self, prompt: str, ground_truth: Any = None, extra_info: Optional[dict] = None) -> None:
        self._truth = ground_truth
        self._counts = {"tool_calls": 0.0, "malformed_calls": 0.0, "answered": 0.0}

    def step(self, model_turn: str) -> Step:
        if CALL_OPEN not in model_turn:
            self._counts["answered"] = 1.0
            return None, float(self.score(model_turn, self._truth)), True
        tool, args, why = parse_tool_call(model_turn, self._by_name)
        if tool is None:
            self._counts["malformed_calls"] += 1
            observation, reward = f"error: {why}", 0.0
        else:
            self._counts["tool_calls"] += 1
            observation, reward = tool.call(args), self.call_reward
        done = self._counts["tool_calls"] + self._counts["malformed_calls"] >= self.max_calls
        return observation, reward, done

    def stats(self) -> dict[str, float]:
        return dict(self._counts)
