"""A rule-based reward applied to a rollout batch, where the batch is made (the rollout's worker).

`rule_scores(batch, fn, name)` calls the reward function once a response and
returns the scores [B]; what a user's function does wrong stops the run with
one line naming it: `RewardError` "reward.function NAME raised ... (at
file:line)" for an exception (the deepest line in the function's own file),
or "returned X (a str, not a number) ..." for a value that is not one finite
number (`score`, `RewardValueError`).
"""
from __future__ import annotations

import inspect
import math
import numbers
import time
import traceback
from typing import Any, Callable

import torch
from torch import Tensor

from hybridflow.common import shown_value
from hybridflow.data import fields as F


class RewardValueError(TypeError):
    """A reward function returned something that is not a finite number; the message names the function."""


class RewardError(RuntimeError):
    """A reward function failed on a response or returned a non-number: the message, one line, names the
    function (`reward.function`) and where."""


def score(batch: dict[str, Any], reward_fn: Callable) -> Tensor:
    """The rule-based reward of each decoded response [B]."""
    return torch.tensor([_reward_value(reward_fn(src, text, truth, extra), reward_fn)
                         for src, text, truth, extra in zip(batch[F.DATA_SOURCE], batch[F.RESPONSE_TEXT],
                                                            batch[F.GROUND_TRUTH], batch[F.EXTRA_INFO])])


def rule_scores(batch: dict[str, Any], reward_fn: Callable, name: str) -> Tensor:
    """`score`, with the reward function's own failure as a `RewardError` naming it (`name`: the config's
    reward.function) and the line it failed on (it is user code)."""
    try:
        return score(batch, reward_fn)
    except RewardValueError as exc:  # the function ran; what it returned is wrong (named in the message)
        raise RewardError(f"reward.function {name!r} {exc}") from exc
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        caller = max((i for i, f in enumerate(frames) if f.filename == __file__), default=-1)
        user = frames[caller + 1:] or frames  # from the reward function's own frame down
        frame = [f for f in user if f.filename == user[0].filename][-1]  # its deepest line in its own file
        raise RewardError(f"reward.function {name!r} raised {type(exc).__name__}: {exc} "
                          f"(at {frame.filename}:{frame.lineno})") from exc


def score_rule(batch: dict[str, Any], reward_fn: Callable, name: str) -> dict[str, Any]:
    """`batch` with RULE_SCORES (`rule_scores`) and RULE_REWARD_SECONDS, the seconds that took spread over the
    rows: where the rollout scores, the scoring's time would otherwise count only in the rollout's."""
    started = time.perf_counter()
    batch[F.RULE_SCORES] = scores = rule_scores(batch, reward_fn, name)
    batch[F.RULE_REWARD_SECONDS] = torch.full((len(scores),), (time.perf_counter() - started) / max(len(scores), 1))
    return batch


def _reward_value(value: Any, reward_fn: Callable) -> float:
    """`value` as a float if it is one finite real number (a bool, int, float, or a 0-d numpy/torch number),
    or a dict holding one under "score" (as verl's custom rewards may return; the other keys are not used)."""
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "size", None) == 1:  # a numpy scalar or 1-element array
        value = value.item()
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    what = "not a finite number" if isinstance(value, numbers.Real) else f"a {type(value).__name__}, not a number"
    raise RewardValueError(f"returned {shown_value(value)} ({what}): a reward function returns one float per "
                           f"response, defined at {_where(reward_fn)}")


def _where(fn: Callable) -> str:
    """`file:line` of a function's definition, or its repr when it has no source (a builtin, a partial)."""
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return repr(fn)
