"""The `code` reward: the response's Python program run against the row's tests in a sandbox.

The program is the last fenced code block of the response (```python ... ```
or ``` ... ```), or the whole response when it has none. The tests come in
the ground truth (a JSON string or a dict), in the columns verl's and PRIME's
code datasets use:

* stdin/stdout cases: ``{"inputs": [...], "outputs": [...]}``: each input is
  fed to a fresh run of the program, and passes when its stdout equals the
  output (trailing whitespace of each line and trailing blank lines ignored);
* call cases: the same plus ``"fn_name"``: each input is the JSON list of
  arguments of that function, and its return value must equal the output;
* assert cases: ``{"asserts": ["assert f(1) == 2", ...]}`` (also read from
  ``"assert_case"`` or ``"test_list"``), all in one run after the program.

The score is the share of tests passed (`limits.score: fraction`) or 1.0 only
when all pass (`all`). Calls and asserts count only when the run prints a
random token after the tests and exits 0: a program that exits early, patches
`sys.exit`/`os._exit`, or registers an exit hook cannot fake a pass: the token
reaches the runner on stdin and lives in a function's locals, so only a
program that walks the interpreter's frames could find it.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any, Optional

from hybridflow.config.schema import SandboxConfig
from hybridflow.rewards.sandbox import Sandbox

__all__ = ["extract_program", "read_tests", "code_reward", "Tests"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs the program and then each test in one process; prints the token and one bit per test at the very end.
# It unlinks itself, reads the token from stdin, and keeps its bookkeeping in a function's locals and its own
# references to what it needs, all before the program runs and can patch the process.
_RUNNER = """import os, sys
PROGRAM, TESTS = {program!r}, {tests!r}
def _main():
    os.unlink(__file__)
    token = sys.stdin.readline().strip()
    write, exit_, flush, tests = os.write, os._exit, sys.stdout.flush, TESTS
    namespace = {{"__name__": "__main__"}}
    exec(compile(PROGRAM, "solution.py", "exec"), namespace)
    passed = []
    for test in tests:
        try:
            exec(compile(test, "test", "exec"), namespace)
            passed.append("1")
        except BaseException:
            passed.append("0")
    try:
        flush()
    except BaseException:
        pass
    write(1, ("\\n" + token + " " + "".join(passed) + "\\n").encode())
    exit_(0)
_main()
"""

# A function called with each case's JSON arguments; the repr of what it returns is compared with the output's.
_CALL = "assert {fn}(*__import__('json').loads({args!r})) == __import__('json').loads({expected!r})"


class Tests:
    """A row's tests: stdio cases (input, expected stdout) and assert statements (calls become asserts)."""

    def __init__(self, stdio: list[tuple[str, str]], asserts: list[str]):
        self.stdio, self.asserts = stdio, asserts

    def __len__(self) -> int:
        return len(self.stdio) + len(self.asserts)


def extract_program(response: str) -> str:
    """The last fenced code block of `response`, or all of it when there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def read_tests(ground_truth: Any) -> Tests:
    """The tests in a row's ground truth (see the module docstring); ValueError naming what is wrong."""
    spec = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(spec, dict):
        raise ValueError(f"code ground truth must be a JSON object of tests, got {type(spec).__name__}")
    asserts = next((spec[k] for k in ("asserts", "assert_case", "test_list") if k in spec), [])
    if isinstance(asserts, str):
        asserts = [asserts]
    inputs, outputs = spec.get("inputs", []), spec.get("outputs", [])
    if len(inputs) != len(outputs):
        raise ValueError(f"code tests have {len(inputs)} inputs but {len(outputs)} outputs")
    fn = spec.get("fn_name")
    if fn:
        if not str(fn).isidentifier():
            raise ValueError(f"code tests' fn_name {fn!r} is not a Python name")
        calls = [_CALL.format(fn=fn, args=json.dumps(i), expected=json.dumps(o)) for i, o in zip(inputs, outputs)]
        return Tests([], [*calls, *map(str, asserts)])
    tests = Tests([(_text(i), _text(o)) for i, o in zip(inputs, outputs)], [str(a) for a in asserts])
    if not len(tests):
        raise ValueError("code ground truth holds no tests (inputs/outputs, fn_name, or asserts)")
    return tests


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _same_output(got: str, want: str) -> bool:
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(want)


def _assert_passes(sandbox: Sandbox, program: str, asserts: list[str]) -> int:
    token = secrets.token_hex(16)
    runner = _RUNNER.format(program=program, tests=tuple(asserts))
    result = sandbox.run({"main.py": runner}, token + "\n")
    if not result.ok:
        return 0
    last = result.stdout.rstrip("\n").rsplit("\n", 1)[-1].split(" ")
    if len(last) != 2 or last[0] != token or len(last[1]) != len(asserts):
        return 0
    return last[1].count("1")


def run_tests(program: str, tests: Tests, limits: SandboxConfig, sandbox: Optional[Sandbox] = None) -> int:
    """How many of `tests` the program passes."""
    sandbox = sandbox or Sandbox(limits)
    passed = 0
    for stdin, want in tests.stdio:
        result = sandbox.run({"main.py": program}, stdin)
        passed += result.ok and _same_output(result.stdout, want)
    return passed + (_assert_passes(sandbox, program, tests.asserts) if tests.asserts else 0)


def code_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None,
                limits: SandboxConfig = SandboxConfig()) -> float:
    """Registry entry "code": the share of the row's tests the response's program passes (or all-or-nothing)."""
    tests = read_tests(ground_truth)
    passed = run_tests(extract_program(solution_str), tests, limits)
    if limits.score == "all":
        return float(passed == len(tests))
    return passed / len(tests)
