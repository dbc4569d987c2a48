"""Rewards never stall or kill a run: a time limit per call, failures scored 0 and counted, too many stop it."""
import os
import re
import time

import pytest
import torch

from hybridflow.data import fields as F
from hybridflow.rewards.guard import GuardedReward
from hybridflow.roles.scoring import RewardError, reward_counts, score_rule
from hybridflow.rewards.scorer import FunctionScorer


def _batch(texts):
    n = len(texts)
    return {F.DATA_SOURCE: ["t"] * n, F.RESPONSE_TEXT: list(texts), F.GROUND_TRUTH: ["1"] * n,
            F.EXTRA_INFO: [{}] * n}


def flaky(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise KeyError("no such thing")
    if solution_str == "hang":
        time.sleep(30)
    if solution_str == "text":
        return "1.0"
    if solution_str == "crash":
        os._exit(3)
    return float(solution_str == ground_truth)


def test_a_raising_hanging_or_wrong_row_scores_0_and_the_rest_score(caplog):
    guard = GuardedReward(flaky, "flaky", timeout_s=0.2, workers=0)
    started = time.monotonic()
    outcomes = guard.score_rows([("t", s, "1", None) for s in ("1", "raise", "hang", "text", "0", "1")])
    assert time.monotonic() - started < 10  # the hanging call (30 s) was left behind, not waited for
    assert [o.score for o in outcomes] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert [o.kind for o in outcomes] == [None, "error", "timeout", "value", None, None]
    assert re.search(r"raised KeyError: 'no such thing' \(at .*test_guard.py:\d+\)", outcomes[1].text)
    assert "reward.timeout_s=0.2" in outcomes[2].text and "returned '1.0' (a str" in outcomes[3].text


def test_failures_within_the_fraction_are_counted_and_logged_beyond_it_stop_the_run(caplog):
    batch = _batch(["1"] * 9 + ["raise"])
    score_rule(batch, FunctionScorer(flaky, "flaky", max_failure_fraction=0.1), "flaky")
    assert batch[F.RULE_SCORES].tolist() == [1.0] * 9 + [0.0]
    assert reward_counts(batch) == {"reward/failures": 1.0, "reward/timeouts": 0.0}
    assert F.REWARD_FAILED not in batch
    assert "row 9" in caplog.text and "KeyError" in caplog.text
    with pytest.raises(RewardError, match=r"reward.function 'flaky' raised KeyError.*on row 8 \(data_source 't'\)"
                                          r".*2 failing rows of 10, more than reward.max_failure_fraction=0.1"):
        score_rule(_batch(["1"] * 8 + ["raise", "raise"]), FunctionScorer(flaky, "flaky"), "flaky")


def test_a_plain_function_is_guarded_the_same_way():
    batch = score_rule(_batch(["1", "0"]), flaky, "flaky")
    assert batch[F.RULE_SCORES].tolist() == [1.0, 0.0] and batch[F.REWARD_FAILED].sum() == 0
    with pytest.raises(RewardError, match="reward.function 'flaky' returned '1.0'"):
        score_rule(_batch(["text"]), flaky, "flaky")


@pytest.mark.slow
def test_in_processes_a_hanging_or_crashing_call_is_killed_and_its_process_replaced():
    """Each of 2 processes: the hanging call is killed at the limit, the crashing one costs its row only, and
    the pool goes on scoring; no process of the pool outlives close()."""
    guard = GuardedReward(flaky, "flaky", timeout_s=0.5, workers=2)
    rows = [("t", s, "1", None) for s in ("hang", "1", "crash", "raise", "1", "hang", "0", "1")]
    started = time.monotonic()
    outcomes = guard.score_rows(rows)
    assert time.monotonic() - started < 10
    assert [o.kind for o in outcomes] == ["timeout", None, "crash", "error", None, "timeout", None, None]
    assert [o.score for o in outcomes] == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert "exit code 3" in outcomes[2].text
    assert guard.score_rows(rows[1:2])[0].score == 1.0  # the replaced processes still score
    os.kill(guard._runner.workers[0].process.pid, 9)  # one dies while idle (as the OOM killer would do it)
    guard._runner.workers[0].process.join(5)
    assert [o.score for o in guard.score_rows(rows[1:3] + rows[4:5])] == [1.0, 0.0, 1.0]
    pids = [w.process.pid for w in guard._runner.workers]
    guard.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
