"""Tools and environments (hybridflow/envs): the restricted parser refuses what is not arithmetic, a tool's
failure or time-out is an observation, ToolEnv runs calls until an answer, env.function specs load."""
from __future__ import annotations

import time

import pytest

from hybridflow.envs import (CALCULATOR, PYTHON, ExpressionError, Tool, ToolEnv, calculator_tool, evaluate,
                             final_integer_score, load_env_factory, make_calculator_env, python_tool)


@pytest.mark.parametrize("text, value", [("123 * 45", 5535), ("(2 + 3) * -4", -20), ("7 / 2", 3.5),
                                         ("1e3 + 1", 1001.0)])
def test_calculator_computes(text, value):
    assert evaluate(text, CALCULATOR) == value


@pytest.mark.parametrize("text, value", [("2 ** 10 % 7", 2), ("max(3, 4) ** 2", 16), ("17 // 5", 3),
                                         ("abs(-3) < 4", 1), ("round(2.567, 2)", 2.57)])
def test_python_grammar_computes(text, value):
    assert evaluate(text, PYTHON) == value


@pytest.mark.parametrize("text, why", [
    ("__import__('os').system('true')", "a call of __import__"),
    ("().__class__", "Attribute"),
    ("x + 1", "a name (x)"),
    ("'a' * 3", "a str constant"),
    ("9 ** 9 ** 9", "too large"),
    ("10 ** 50", "too large"),
    ("1 / 0", "division by zero"),
    ("+".join(["1"] * 200), "characters"),
    ("[1, 2]", "List"),
    ("max(1, key=abs)", "a call of max"),
    ("True + 1", "a bool constant"),
])
def test_python_grammar_refuses(text, why):
    with pytest.raises(ExpressionError, match=why.replace("(", r"\(").replace(")", r"\)")):
        evaluate(text, PYTHON)


def test_calculator_refuses_what_only_python_allows():
    with pytest.raises(ExpressionError, match=r"operator \*\*"):
        evaluate("2 ** 3", CALCULATOR)
    with pytest.raises(ExpressionError, match="a call of max"):
        evaluate("max(1, 2)", CALCULATOR)


def test_tool_answers_errors_as_text():
    calc = calculator_tool()
    assert calc.call({"expression": "123*45"}) == "5535"
    assert calc.call({"expression": "7/2"}) == "3.5"
    assert calc.call({"expression": "1/0"}) == "error: division by zero"
    assert calc.call({}) == "error: missing argument 'expression'"
    assert calc.call({"expression": 3}).startswith("error: argument 'expression' must be a JSON string")
    assert calc.call({"expression": "1", "x": 2}).startswith("error: unknown argument 'x'")
    assert python_tool().call({"code": "open('/etc/passwd')"}).startswith("error: python expressions may not")
    assert calc.schema()["function"]["parameters"]["required"] == ["expression"]


def test_tool_that_raises_or_hangs_returns_an_error_observation():
    schema = {"type": "object", "properties": {}}
    boom = Tool("boom", "raises", schema, lambda: 1 / 0)
    assert boom.call({}) == "error: ZeroDivisionError: division by zero"
    slow = Tool("slow", "sleeps", schema, lambda: time.sleep(5), timeout_s=0.2)
    started = time.perf_counter()
    assert slow.call({}) == "error: slow did not answer within 0.2 s"
    assert time.perf_counter() - started < 2
    with pytest.raises(ValueError, match="timeout_s"):
        Tool("t", "", schema, lambda: 0, timeout_s=0)


def test_tool_env_runs_calls_until_an_answer():
    env = make_calculator_env()
    env.reset("What is 123 * 45?", ground_truth="5535")
    obs, reward, done = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}'
                                 '</tool_call>')
    assert (obs, reward, done) == ("5535", 0.0, False)
    obs, reward, done = env.step("<tool_call>{not json}</tool_call>")
    assert obs.startswith("error: the call is not JSON") and not done
    obs, _, _ = env.step('<tool_call>{"name": "calc", "arguments": {}}</tool_call>')
    assert obs == "error: unknown tool 'calc'; tools: ['calculator']"
    assert env.step("The answer is 5,535.") == (None, 1.0, True)
    assert env.stats() == {"tool_calls": 1.0, "malformed_calls": 2.0, "answered": 1.0}
    env.reset("again", ground_truth="7")
    assert env.step("It is 8.") == (None, 0.0, True)


def test_tool_env_ends_after_max_calls():
    env = ToolEnv(tools=[calculator_tool()], score=final_integer_score, max_calls=2, call_reward=0.1)
    env.reset("p", ground_truth="1")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    assert env.step(call) == ("1", 0.1, False)
    assert env.step(call + " and more") == ("1", 0.1, True)


def test_env_specs_load_by_name_and_file(tmp_path):
    assert load_env_factory("calculator") is make_calculator_env
    with pytest.raises(ValueError, match="did you mean 'calculator'"):
        load_env_factory("calculater")
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_env_factory(str(tmp_path / "nope.py") + ":make_env")
    path = tmp_path / "my_env.py"
    path.write_text("from hybridflow.envs import make_python_env\n"
                    "def make_env():\n    return make_python_env()\n"
                    "def needs_args(x):\n    return None\n"
                    "def not_an_env():\n    return 3\n")
    assert load_env_factory(f"{path}:make_env")().tools[0].name == "python"
    with pytest.raises(ValueError, match="has no function 'make'"):
        load_env_factory(f"{path}:make")
    with pytest.raises(ValueError, match="must take no arguments"):
        load_env_factory(f"{path}:needs_args")
    with pytest.raises(ValueError, match="returned int, which has no reset"):
        load_env_factory(f"{path}:not_an_env")


def test_tool_problems_are_disjoint_products_with_the_call_format():
    from hybridflow.data.arithmetic import TOOL_SYSTEM, generate_tool_splits

    train, test = generate_tool_splits(50, 10, seed=3)
    assert len(train) == 50 and len(test) == 10
    seen = {r["prompt"][-1]["content"] for r in train}
    assert not seen & {r["prompt"][-1]["content"] for r in test}
    for row in train + test:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert 100 <= a < 1000 and 10 <= b < 100 and row["reward_model"]["ground_truth"] == str(a * b)
        assert row["prompt"][0] == {"role": "system", "content": TOOL_SYSTEM}
        assert row["prompt"][-1] == {"role": "user", "content": f"What is {a} * {b}?"}
    env = make_calculator_env()  # the worked example in every prompt is a call the calculator accepts
    env.reset("", ground_truth="7955")
    assert env.step(train[0]["prompt"][2]["content"]) == ("7955", 0.0, False)


def test_shaped_calculator_rewards_each_well_formed_call():
    env = load_env_factory("calculator_shaped")()
    env.reset("", ground_truth="5535")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
    assert env.step(call) == ("5535", 0.2, False)
    assert env.step("<tool_call>{bad</tool_call>")[1] == 0.0  # a malformed call earns nothing
    assert env.step("5535") == (None, 1.0, True)
