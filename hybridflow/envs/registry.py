"""The shipped environments and how a config names one: `env.function: calculator` or `path/to/file.py:make_env`.

A factory takes no arguments and returns a fresh `Environment`: the agent loop
calls it once per trajectory, so an environment keeps its episode's state on
itself with nothing shared between rows. Files load as reward files do
(`hybridflow.common.load_source_file`).
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, Callable

from hybridflow.envs.base import Environment, ToolEnv
from hybridflow.envs.tools import calculator_tool, python_tool
from hybridflow.common import load_source_file, nearest_name

__all__ = ["ENVIRONMENTS", "EnvFactory", "final_integer_score", "load_env_factory", "make_calculator_env",
           "make_python_env", "make_shaped_calculator_env", "check_factory"]

EnvFactory = Callable[[], Environment]

_INTEGER = re.compile(r"-?\d[\d,]*")


def final_integer_score(answer: str, ground_truth: Any) -> float:
    """1.0 when the last integer written in `answer` (thousands commas allowed) equals the ground truth."""
    found = _INTEGER.findall(answer)
    if not found:
        return 0.0
    try:
        return 1.0 if int(found[-1].replace(",", "")) == int(str(ground_truth).strip()) else 0.0
    except ValueError:
        return 0.0


def make_calculator_env() -> ToolEnv:
    """The calculator tool; the final answer's last integer is scored against the ground truth."""
    return ToolEnv(tools=[calculator_tool()], score=final_integer_score)


def make_shaped_calculator_env() -> ToolEnv:
    """The calculator environment with a per-turn reward of 0.2 for each well-formed call (at most
    ToolEnv.max_calls): a signal for a model that rarely answers right before it uses the tool."""
    return ToolEnv(tools=[calculator_tool()], score=final_integer_score, call_reward=0.2)


def make_python_env() -> ToolEnv:
    """The Python-expression tool (restricted parser); scored as the calculator environment."""
    return ToolEnv(tools=[python_tool()], score=final_integer_score)


ENVIRONMENTS: dict[str, EnvFactory] = {"calculator": make_calculator_env, "calculator_shaped": make_shaped_calculator_env,
                                       "python": make_python_env}


def load_env_factory(spec: str) -> EnvFactory:
    """The factory a config's `env.function` names: a shipped name or "file.py:function"; a ValueError or
    FileNotFoundError naming the spec otherwise. The factory is called once here, so a factory that
    fails or returns something else fails at start-up."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"env.function must be a name or 'path/to/file.py:function', got {spec!r}")
    spec = spec.strip()
    if ":" not in spec:
        if spec not in ENVIRONMENTS:
            close = nearest_name(spec, ENVIRONMENTS)
            hint = f"did you mean {close!r}? " if close else ""
            raise ValueError(f"unknown environment {spec!r}; {hint}known: {', '.join(sorted(ENVIRONMENTS))} "
                             "(or give 'path/to/file.py:function')")
        return ENVIRONMENTS[spec]
    file_part, _, name = spec.rpartition(":")
    path = Path(file_part).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"environment file not found: {path} (from env.function {spec!r})")
    factory = getattr(load_source_file(path, "hybridflow_env"), name, None)
    if not callable(factory):
        raise ValueError(f"environment file {path} has no function {name!r} (from env.function {spec!r})")
    check_factory(factory, spec)
    return factory


def check_factory(factory: Any, label: str) -> None:
    """A factory must be callable with no arguments and return an Environment-like object."""
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ValueError(f"env.function {label!r} must take no arguments (it makes one environment per "
                         f"trajectory), but its signature is {inspect.signature(factory)}") from None
    except ValueError:  # no introspectable signature: the call below tells
        pass
    env = factory()
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"env.function {label!r} returned {type(env).__name__}, which has no {missing[0]}() "
                         "(an environment has reset(prompt, ground_truth, extra_info) and step(turn))")
