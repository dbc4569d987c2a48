"""The shipped code task (hybridflow/assets/code_task) is what tools/make_code_task.py writes, and every test in
it holds for the reference implementation, so a correct answer can score 1."""
import importlib.util
import json
import random
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_code_task.py"


def _tool():
    spec = importlib.util.spec_from_file_location("make_code_task", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_files_are_the_generators_output_and_splits_share_no_function():
    train, test = _tool().generate(0)
    for name, rows in (("train", train), ("test", test)):
        assert pq.read_table(ROOT / "hybridflow" / "assets" / "code_task" / f"{name}.parquet").to_pylist() == rows
    assert len(train) + len(test) >= 250
    signature = lambda row: row["prompt"][0]["content"].split("`")[1]  # noqa: E731
    assert not {signature(r) for r in train} & {signature(r) for r in test}
    assert {r["extra_info"]["family"] for r in test} == {r["extra_info"]["family"] for r in train}


def test_every_problems_tests_hold_for_its_reference_and_fail_for_a_wrong_answer():
    tool = _tool()
    for family, (params, signature, _, reference, _) in tool.FAMILIES.items():
        for k in params:
            problem = tool.make_problem(family, k, random.Random(0))
            name = signature(k).split("(")[0]
            assert len(problem["tests"]) == 4 and name in problem["prompt"] and name.isidentifier()
            for test in problem["tests"]:
                exec(test, {name: reference(k)})
            wrong = 0
            for test in problem["tests"]:
                try:
                    exec(test, {name: lambda *a: None})
                except AssertionError:
                    wrong += 1
            assert wrong >= 1, (family, k)
    row = _tool().generate(0)[1][0]
    assert set(json.loads(row["reward_model"]["ground_truth"])) == {"asserts"} and row["data_source"] == "code"
