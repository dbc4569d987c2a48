"""Verifier for the built-in addition task."""
from __future__ import annotations

import pytest

from hybridflow.rewards.arithmetic import compute_score, leading_digits


@pytest.mark.parametrize("response,score", [
    ("0959", 1.0),
    ("0959<eos>", 1.0),
    ("0959<eos><pad><pad>", 1.0),
    (" 0959\n", 1.0),
    ("0959+1", 1.0),  # only the leading digits count
    ("959", 0.0),  # the fixed width is part of the answer
    ("00959", 0.0),
    ("0958", 0.0),
    ("", 0.0),
    ("<eos>0959", 0.0),
    ("x0959", 0.0),
    ("٠٩٥٩", 0.0),  # Arabic-Indic digits are not ASCII digits
])
def test_strict_padding(response, score):
    assert compute_score(response, "0959") == score


def test_lenient_padding_compares_values():
    assert compute_score("959<eos>", "0959", strict_padding=False) == 1.0
    assert compute_score("00959", "0959", strict_padding=False) == 1.0
    assert compute_score("958", "0959", strict_padding=False) == 0.0
    assert compute_score("<eos>", "0959", strict_padding=False) == 0.0


def test_leading_digits_and_bad_truth():
    assert leading_digits("  123abc45") == "123"
    assert leading_digits("abc") == ""
    assert compute_score("42", 42) == 1.0
    with pytest.raises(ValueError, match="digits"):
        compute_score("1", "1.5")


@pytest.mark.parametrize("response,strict,lenient", [
    ("42", 1.0, 1.0), ("17 + 25 = 42.", 1.0, 1.0), ("The answer is 42!\n", 1.0, 1.0),
    ("42, not 32", 0.0, 1.0),  # the last integer decides; the lenient reading finds it anywhere
    ("17 + 25 = 32", 0.0, 0.0), ("forty-two", 0.0, 0.0), ("42.5", 0.0, 0.0), ("142", 0.0, 0.0), ("", 0.0, 0.0)])
def test_chat_rewards_read_the_last_integer_or_any(response, strict, lenient):
    from hybridflow.rewards import get_reward_fn
    assert get_reward_fn("arithmetic_chat")("arithmetic_chat", response, "42") == strict
    assert get_reward_fn("arithmetic_chat_lenient")("arithmetic_chat", response, "42") == lenient
