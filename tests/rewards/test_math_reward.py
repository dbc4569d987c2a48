"""The `math` reward: math-verify's equivalence on a table of pairs, and a hanging comparison that costs a row."""
import time

import pytest

pytest.importorskip("math_verify")

from hybridflow.data import fields as F  # noqa: E402
from hybridflow.rewards.math import last_boxed, math_reward  # noqa: E402
from hybridflow.config.schema import RewardConfig  # noqa: E402
from hybridflow.roles.scoring import build_scorer, score_rule  # noqa: E402

# (ground truth, response, equivalent?) written for this test.
TABLE = [
    ("\\frac{1}{2}", "so the answer is \\boxed{0.5}", True),
    ("0.5", "We get \\boxed{\\dfrac{1}{2}}.", True),
    ("1/2", "Therefore $\\frac12$", True),
    ("[1, 2)", "The set is \\boxed{[1,2)}", True),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}", True),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", True),
    ("10\\%", "\\boxed{0.1}", True),
    ("3", "first \\boxed{2}, then corrected: \\boxed{3}", True),
    ("(0, 1]", "\\boxed{[0, 1]}", False),
    ("\\pi", "\\boxed{3.14}", False),
    ("3", "\\boxed{4}", False),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
    ("7", "I do not know", False),
    ("2", "\\boxed{", False),
]


def test_last_boxed_reads_balanced_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None and last_boxed("none") is None


@pytest.mark.slow  # sympy: about 3 s for the table
@pytest.mark.parametrize("truth,response,equal", TABLE)
def test_math_verify_decides_equivalence(truth, response, equal):
    assert math_reward("math", response, truth) == float(equal)


# Answers whose comparison with sympy runs for minutes (towers of exponents): they must cost one row only.
HANGING = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{10^{10^{10^{10^{10}}}}-1}"]


@pytest.mark.slow
def test_a_hanging_comparison_scores_0_as_a_timeout_and_the_step_goes_on():
    import math_verify  # noqa: F401  (imported before the pool forks, so each process has it)

    responses = ["\\boxed{2}", *HANGING, "\\boxed{\\frac{4}{2}}", "\\boxed{3}"]
    batch = {F.DATA_SOURCE: ["m"] * 5, F.RESPONSE_TEXT: responses, F.GROUND_TRUTH: ["2"] * 5,
             F.EXTRA_INFO: [{}] * 5}
    scorer = build_scorer(RewardConfig(function="math", timeout_s=2.0, max_failure_fraction=0.5))
    assert scorer.guard.workers == 2  # math scores in processes even when reward.workers is 0
    started = time.monotonic()
    try:
        score_rule(batch, scorer, "math")
    finally:
        scorer.close()
    assert time.monotonic() - started < 30  # each tower would take minutes
    assert batch[F.RULE_SCORES].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert batch[F.REWARD_TIMED_OUT].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
