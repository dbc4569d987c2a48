"""reward.kind judge: the verdict parse rule, and the built-in engine's answers scored and counted by it."""
from pathlib import Path

import pytest

from hybridflow.config.schema import JudgeConfig, RewardConfig
from hybridflow.data import fields as F
from hybridflow.roles.judge import JudgeReward, parse_verdict
from hybridflow.roles.scoring import RewardError, build_scorer, score_rule

DEMO = Path(__file__).resolve().parents[2] / "hybridflow" / "assets" / "demo_model"


@pytest.mark.parametrize("answer,verdict,scale,expected", [
    (" Yes, it is right.", "yes_no", 1, 1.0),
    ("no", "yes_no", 1, 0.0),
    ("Yes... on reflection, no.", "yes_no", 1, 0.0),  # the last verdict word counts
    ("nobody knows; yesterday", "yes_no", 1, None),  # whole words only
    ("I give it 7 out of", "number", 10, 0.7),
    ("score: 12", "number", 10, 1.0),  # clipped
    ("-3", "number", 10, 0.0),
    ("2.5", "number", 5, 0.5),
    ("", "number", 10, None),
])
def test_the_verdict_parse_rule(answer, verdict, scale, expected):
    assert parse_verdict(answer, verdict, scale) == expected


@pytest.mark.slow
def test_the_demo_model_judges_and_answers_without_a_verdict_count_as_failures():
    """The tiny demo model (a 3-digit adder) as a "number" judge of "{response}": it answers an open sum with
    digits and a finished one with EOS at once, an empty answer without a verdict. Scores and failures follow
    parse_verdict on the same greedy answers."""
    cfg = JudgeConfig(model_path=str(DEMO), template="{response}", verdict="number", scale=2000,
                      max_new_tokens=6, batch_size=4)
    responses = ["123+456=", "123+456=0579", "12+3=", "450+101=0551", "7+88=", "999+999=1998"]
    batch = {F.DATA_SOURCE: ["j"] * 6, F.PROMPT_TEXT: ["q"] * 6, F.RESPONSE_TEXT: responses,
             F.GROUND_TRUTH: ["-"] * 6, F.EXTRA_INFO: [{}] * 6}
    scorer = build_scorer(RewardConfig(kind="judge", judge=cfg, max_failure_fraction=1.0))
    assert isinstance(scorer, JudgeReward)
    answers = scorer.answers(responses)
    expected = [parse_verdict(a, "number", 2000) for a in answers]
    assert 0 < sum(v is None for v in expected) < 6, answers  # both kinds occur, so the counts below mean something
    score_rule(batch, scorer, "judge")
    assert batch[F.RULE_SCORES].tolist() == pytest.approx([v or 0.0 for v in expected])
    assert batch[F.REWARD_FAILED].tolist() == [float(v is None) for v in expected]
    assert expected[0] == pytest.approx(int(answers[0]) / 2000)
    with pytest.raises(RewardError, match=r"reward judge .*demo_model gave no number verdict: ''; on row 1 "):
        score_rule(dict(batch), JudgeReward(cfg, max_failure_fraction=0.0, model=scorer.model), "judge")
