"""GSM8K verifier: every real reference solution, and hand-made edge cases."""
from __future__ import annotations

from decimal import Decimal

import pytest

from hybridflow.data import gsm8k
from hybridflow.rewards.gsm8k import compute_score, extract_solution, normalize_number


def reference_solutions() -> list[tuple[str, str]]:
    """(solution, final answer) for all of GSM8K, the answer taken independently of the verifier."""
    pairs = []
    for split in gsm8k.SPLITS:
        for record in gsm8k.records(split=split):
            solution = record["answer"]
            pairs.append((solution, solution.split("####")[-1].strip().replace(",", "")))
    return pairs


@pytest.fixture(scope="module")
def solutions():
    pairs = reference_solutions()
    assert len(pairs) == 7473 + 1319
    return pairs


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_every_reference_solution_scores_one(solutions, method):
    failures = [(s, t) for s, t in solutions if compute_score(s, t, method=method) != 1.0]
    assert not failures, f"{len(failures)} reference solutions failed, first: {failures[0]}"


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_every_altered_solution_scores_zero(solutions, method):
    failures = []
    for solution, truth in solutions:
        head, _, _ = solution.rpartition("####")
        altered = f"{head}#### {Decimal(truth) + 1}"
        if compute_score(altered, truth, method=method) != 0.0:
            failures.append(altered)
    assert not failures, f"{len(failures)} altered solutions scored, first: {failures[0]!r}"


@pytest.mark.parametrize("response,truth", [
    ("so the total is #### 1,000", "1000"),
    ("#### $1,234.", "1234"),
    ("#### 72.0", "72"),
    ("#### 72", "72.00"),
    ("#### -5", "-5"),
    ("#### $-5", "-5"),
    ("####-5", "-5"),
    ("#### 0.5", ".5"),
    ("#### 3.75 dollars", "3.75"),
    ("first #### 1 then #### 2", "2"),
    ("####\n  42", "42"),
])
def test_strict_hand_cases_match(response, truth):
    assert compute_score(response, truth) == 1.0


@pytest.mark.parametrize("response,truth", [
    ("The answer is 42", "42"),  # no marker: strict finds nothing
    ("#### forty-two", "42"),
    ("first #### 2 then #### 1", "2"),  # the last marker counts
    ("#### 5", "-5"),
    ("#### 1,0000", "10000"),  # not a thousands group: reads as 1
    ("", "0"),
])
def test_strict_hand_cases_miss(response, truth):
    assert compute_score(response, truth) == 0.0


@pytest.mark.parametrize("response,truth,score", [
    ("She pays $1,200.", "1200", 1.0),
    ("10 - 3 = 7", "7", 1.0),
    ("x = -7.5.", "-7.5", 1.0),
    ("12-5", "5", 1.0),  # subtraction, not a negative number
    ("counts 1,2,3", "3", 1.0),
    ("no digits here", "0", 0.0),
    ("it is 41 or 42", "41", 0.0),
])
def test_flexible_hand_cases(response, truth, score):
    assert compute_score(response, truth, method="flexible") == score


def test_format_score_and_custom_score():
    assert compute_score("#### 3", "4", format_score=0.1) == 0.1
    assert compute_score("no answer", "4", format_score=0.1) == 0.0
    assert compute_score("#### 4", "4", score=2.0) == 2.0


def test_normalize_and_extract():
    assert normalize_number(" $1,000. ") == Decimal(1000)
    assert normalize_number("NaN") is None and normalize_number("Infinity") is None
    assert normalize_number("abc") is None
    assert extract_solution("a 1 b 2", "flexible") == "2"
    assert extract_solution("a 1 b 2", "strict") is None
    with pytest.raises(ValueError, match="method"):
        extract_solution("#### 1", "loose")


def test_non_numeric_ground_truth_compares_text():
    assert compute_score("#### 5", "five") == 0.0
    assert compute_score("#### 5", 5) == 1.0
