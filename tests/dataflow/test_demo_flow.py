"""The docs/api.md flow on the shipped models: sync == async, and examples/my_rl_flow.py end to end."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow import DataFlow, Node
from hybridflow.rewards.registry import get_reward_fn

REPO = Path(__file__).resolve().parents[2]


def _truth(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return f"{int(a) + int(b):0{len(a) + 1}d}"


def test_async_matches_sync_with_the_demo_model_and_a_rule_reward(actor):
    rule = get_reward_fn("arithmetic")
    rollout = Node(name="rollout", model=actor,
                   forward_fn=lambda model, prompts: model.generate(prompts, max_new_tokens=8))
    reward = Node(name="reward", model=rule,
                  forward_fn=lambda fn, batch: [fn("arithmetic", r, _truth(p)) for p, r in batch])
    flow = DataFlow(nodes=[rollout, reward], edges=[(rollout, reward)])
    prompts = [f"{a:03d}+{b:03d}=" for a, b in [(42, 917), (123, 456), (5, 5), (250, 250), (999, 1),
                                                 (314, 159), (271, 828), (100, 900)]]
    sync = flow.run(prompts)
    asyn = flow.run(prompts, async_execution=True, min_batch=2)
    assert asyn.outputs == sync.outputs and asyn.final == sync.final
    assert len(sync.final) == 8 and 0 < sum(sync.final) < 8  # the demo model gets some right
    assert asyn.overlap_s > 0.0 and sync.overlap_s == 0.0
    assert asyn.stats["rollout"].items_out == 8 and asyn.stats["reward"].items_in == 8


def _run_example(*args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "examples/my_rl_flow.py", "--prompts", "['042+917=', '123+456=']", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "vLLM is not installed" in proc.stderr or "vllm" not in proc.stderr.lower()
    return proc.stdout.splitlines()


def _rewards(line: str) -> list[float]:
    match = re.fullmatch(r"Final rewards: \[(.*)\]", line)
    assert match, line
    return [float(x) for x in match.group(1).split(",") if x.strip()]


@pytest.mark.slow  # the example end to end, in a fresh Python
def test_example_prints_the_pipeline_report():
    lines = _run_example()
    assert len(lines) == 3, lines
    assert re.fullmatch(r"\[Rollout\] Generated 2 responses in \d+\.\ds", lines[0])
    assert re.fullmatch(r"\[Reward\] Scored 2 samples in \d+\.\ds", lines[1])
    assert len(_rewards(lines[2])) == 2


@pytest.mark.slow
def test_example_with_safety_scores_only_passing_samples_async():
    lines = _run_example("--safety", "--async", "--min-batch", "1")
    assert len(lines) == 4, lines
    assert re.fullmatch(r"\[Rollout\] Generated 2 responses in \d+\.\ds", lines[0])
    passed = re.fullmatch(r"\[Safety\] Passed (\d) of 2 samples in \d+\.\ds", lines[1])
    assert passed, lines[1]
    scored = re.fullmatch(r"\[Reward\] Scored (\d) samples? in \d+\.\ds", lines[2])
    assert scored and scored.group(1) == passed.group(1)
    assert len(_rewards(lines[3])) == int(passed.group(1))


def test_example_prompts_that_do_not_parse_or_are_empty_get_one_line():
    """A SyntaxError from the --prompts parser used to escape as a traceback, and `[]` ran an empty flow."""
    import argparse

    import pytest

    sys.path.insert(0, str(REPO / "examples"))
    try:
        from my_rl_flow import parse_prompts
    finally:
        sys.path.remove(str(REPO / "examples"))
    assert parse_prompts("['1+1=']") == ["1+1="]
    for text, why in (("['unclosed", "must be a Python list of strings"), ("[]", "is empty"),
                      ("[1, 2]", "must be a Python list of strings")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_prompts(text)


def test_example_prompts_longer_than_the_actor_holds_get_one_line(capsys):
    """A prompt past the demo actor's 64 positions used to be answered anyway, past the positions it was
    trained on; the default --max-new-tokens (128) now shrinks to the room left instead."""
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("my_rl_flow_lengths", REPO / "examples" / "my_rl_flow.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    long = "1+" * 60 + "="
    for args, text in (
            (["--prompts", repr(["042+917=", long])],
             "argument --prompts: prompt 2 ('1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1...') is 122 tokens and leaves no "
             "room for a response: the actor holds max_position_embeddings=64"),
            (["--prompts", "['042+917=']", "--max-new-tokens", "60"],
             "prompt 1 ('042+917=') is 9 tokens and with --max-new-tokens 60 needs 69 positions")):
        with pytest.raises(SystemExit) as exited:
            example.main(args)
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error:" in line]
        assert exited.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert text in errors[0], errors[0]
