"""Tools and environments for multi-turn rollouts, as plain Python: a `Tool` answers a call with text, an
`Environment` answers a model's turn with an observation, a reward and whether the episode is done."""
from hybridflow.envs.base import CALL_CLOSE, CALL_OPEN, Environment, ToolEnv, parse_tool_call
from hybridflow.envs.expression import CALCULATOR, PYTHON, ExpressionError, Grammar, evaluate
from hybridflow.envs.registry import (ENVIRONMENTS, EnvFactory, check_factory, final_integer_score,
                                      load_env_factory, make_calculator_env, make_python_env)
from hybridflow.envs.tools import Tool, calculator_tool, check_arguments, python_tool

__all__ = ["CALCULATOR", "CALL_CLOSE", "CALL_OPEN", "ENVIRONMENTS", "EnvFactory", "Environment", "ExpressionError",
           "Grammar", "PYTHON", "Tool", "ToolEnv", "calculator_tool", "check_arguments", "check_factory",
           "evaluate", "final_integer_score", "load_env_factory", "make_calculator_env", "make_python_env",
           "parse_tool_call", "python_tool"]
