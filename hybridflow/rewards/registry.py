"""Finding reward functions by name or by file, and the default dispatcher.

Every reward function has one signature, the one verl's custom rewards use::

    fn(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float

It returns one finite number (a bool, int, float or a one-element numpy/torch
value), or, as verl allows, a dict with the number under ``"score"``; anything
else stops the run naming what came back (``roles.scoring.score``).

A config names one as a registered name (``"gsm8k"``, ``"arithmetic"``,
``"math"``, ``"code"``, ``"default"``) or as ``"path/to/file.py:function"``, which is loaded with
importlib so user rewards need no packaging. ``"default"`` dispatches on the
row's ``data_source``. Signatures are checked when a function is registered or
loaded, so a wrong one fails at start-up instead of mid-training.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from hybridflow.rewards.arithmetic import arithmetic_reward, chat_arithmetic_reward, mentions_answer
from hybridflow.rewards.code import code_reward
from hybridflow.rewards.gsm8k import gsm8k_flexible_reward, gsm8k_reward
from hybridflow.rewards.math import math_reward
from hybridflow.common import load_source_file, nearest_name

__all__ = ["RewardFn", "register_reward", "get_reward_fn", "registered_rewards", "default_reward",
           "DATA_SOURCE_REWARDS"]

RewardFn = Callable[[str, str, Any, "dict[str, Any] | None"], float]

# The one module-level mutable: name -> reward function, filled by register_reward.
_REGISTRY: dict[str, RewardFn] = {}


def _check_signature(fn: Any, label: str) -> None:
    if not callable(fn):
        raise TypeError(f"reward {label} is not callable (got {type(fn).__name__})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no introspectable signature
        return
    try:
        signature.bind("data_source", "solution_str", "ground_truth", None)
    except TypeError as exc:
        raise TypeError(f"reward {label} must accept (data_source, solution_str, ground_truth, "
                        f"extra_info=None), but its signature is {signature}: {exc}") from None


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available to :func:`get_reward_fn` as ``name``.

    Registering a different function under a taken name is an error, so two
    plugins cannot silently replace each other.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        _check_signature(fn, repr(name))
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"reward {name!r} is already registered to "
                             f"{existing.__module__}.{existing.__qualname__}")
        _REGISTRY[name] = fn
        return fn

    return decorator


def registered_rewards() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def _suggest(word: str, options: list[str]) -> str:
    close = nearest_name(word, options)
    hint = f"did you mean {close!r}? " if close else ""
    return f"{hint}known: {', '.join(sorted(options))}"


def _load_from_file(spec: str) -> RewardFn:
    file_part, _, fn_name = spec.rpartition(":")
    if not file_part or not fn_name:
        raise ValueError(f"reward spec {spec!r} must look like 'path/to/file.py:function'")
    path = Path(file_part).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"reward file not found: {path} (from reward spec {spec!r})")
    module = load_source_file(path, "hybridflow_reward")
    fn = getattr(module, fn_name, None)
    if fn is None:
        functions = sorted(name for name, value in vars(module).items()
                           if inspect.isfunction(value) and not name.startswith("_"))
        raise ValueError(f"reward file {path} has no function {fn_name!r}; {_suggest(fn_name, functions)}")
    _check_signature(fn, f"{path}:{fn_name}")
    return fn


def get_reward_fn(spec: str) -> RewardFn:
    """The reward function for a registered name or a ``"file.py:function"`` spec."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if ":" in spec:
        return _load_from_file(spec)
    if spec not in _REGISTRY:
        raise ValueError(f"unknown reward {spec!r}; {_suggest(spec, list(_REGISTRY))} "
                         f"(or give 'path/to/file.py:function')")
    return _REGISTRY[spec]


# data_source -> reward function used by default_reward.
DATA_SOURCE_REWARDS: Mapping[str, RewardFn] = MappingProxyType({
    "openai/gsm8k": gsm8k_reward,
    "arithmetic": arithmetic_reward,
    "arithmetic_chat": chat_arithmetic_reward,
})


def default_reward(data_source: str, solution_str: str, ground_truth: Any,
                   extra_info: dict[str, Any] | None = None) -> float:
    """Score with the verifier for ``data_source`` (see :data:`DATA_SOURCE_REWARDS`)."""
    fn = DATA_SOURCE_REWARDS.get(data_source)
    if fn is None:
        raise ValueError(f"no default reward for data_source {data_source!r}; "
                         f"{_suggest(str(data_source), list(DATA_SOURCE_REWARDS))}. "
                         f"Set a reward function explicitly ('name' or 'file.py:function').")
    return float(fn(data_source, solution_str, ground_truth, extra_info))


register_reward("gsm8k")(gsm8k_reward)
register_reward("gsm8k_flexible")(gsm8k_flexible_reward)
register_reward("arithmetic")(arithmetic_reward)
register_reward("arithmetic_chat")(chat_arithmetic_reward)
register_reward("arithmetic_chat_lenient")(mentions_answer)
register_reward("default")(default_reward)
register_reward("math")(math_reward)  # math-verify equivalence (rewards/math.py); scored in processes
register_reward("code")(code_reward)  # the program against the row's tests in a sandbox (rewards/code.py)
