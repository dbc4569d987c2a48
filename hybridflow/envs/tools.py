"""`Tool`: a name, a JSON schema for its arguments, `call(args) -> str` and a time limit.

A tool is called with arguments a model wrote, so every failure becomes text
the model reads on its next turn ("error: ..."): arguments that do not match
the schema, an exception inside the tool, or a call that runs past
`timeout_s`. The rollout goes on either way; a tool never stops a batch.

Simplified on purpose: the schema check covers what tool schemas use in
practice (an object's required keys, unknown keys, and the JSON types of
its properties), not all of JSON Schema. A call past its time limit is
abandoned on a daemon thread, not killed (Python cannot stop a thread), so a
tool should bound its own work, as the built-in ones do.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from hybridflow.envs.expression import CALCULATOR, PYTHON, ExpressionError, evaluate

__all__ = ["Tool", "calculator_tool", "check_arguments", "python_tool"]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


def check_arguments(schema: Mapping[str, Any], args: Any) -> Optional[str]:
    """What is wrong with `args` under an object `schema`, naming the key; None when nothing is."""
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    properties = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing argument {missing[0]!r}"
    if not schema.get("additionalProperties", False):
        extra = [k for k in args if k not in properties]
        if extra:
            return f"unknown argument {extra[0]!r}; expected {sorted(properties)}"
    for key, value in args.items():
        kind = properties.get(key, {}).get("type")
        allowed = _JSON_TYPES.get(kind, (object,))
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f"argument {key!r} must be a JSON {kind}, got {type(value).__name__}"
    return None


@dataclass(frozen=True)
class Tool:
    """fn(**args) -> anything printable; `call` turns every outcome into the text the model reads."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a tool needs a non-empty name, got {self.name!r}")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object'")
        if not self.timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")

    def call(self, args: Any) -> str:
        """The tool's answer as text, or "error: ..." (bad arguments, an exception, past the time limit)."""
        problem = check_arguments(self.parameters, args)
        if problem is not None:
            return f"error: {problem}"
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = self.fn(**args)
            except Exception as exc:  # the tool's failure is the model's observation, not the run's
                box["error"] = exc

        worker = threading.Thread(target=run, name=f"tool-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return f"error: {self.name} did not answer within {self.timeout_s:g} s"
        if "error" in box:
            exc = box["error"]
            detail = str(exc) if isinstance(exc, ExpressionError) else f"{type(exc).__name__}: {exc}"
            return f"error: {detail}"
        return str(box["value"])

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function description chat templates render from their `tools` variable."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


def _expression_schema(key: str, what: str) -> dict[str, Any]:
    return {"type": "object", "properties": {key: {"type": "string", "description": what}}, "required": [key]}


def _show(value: float) -> str:
    """Integers as integers ("6075", not "6075.0"); other floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculator_tool(timeout_s: float = 2.0) -> Tool:
    """`calculator(expression)`: + - * / and parentheses over numbers."""
    return Tool("calculator", "Evaluate an arithmetic expression with + - * / and parentheses.",
                _expression_schema("expression", "for example 123 * 45"),
                lambda expression: _show(evaluate(expression, CALCULATOR)), timeout_s)


def python_tool(timeout_s: float = 2.0) -> Tool:
    """`python(code)`: one Python arithmetic expression (+ - * / // % **, comparisons, abs/min/max/round),
    read by the restricted parser of `envs.expression`, never by Python's eval."""
    return Tool("python", "Evaluate one Python arithmetic expression (numbers, + - * / // % **, comparisons, "
                          "abs, min, max, round).",
                _expression_schema("code", "for example max(3, 4) ** 2 % 7"),
                lambda code: _show(evaluate(code, PYTHON)), timeout_s)
