"""Tools agents call: the ``Tool`` type, turn-level execution, and built-in tools."""

from ctxrl.tools.base import Tool, execute_tool_calls, schema_problems, validate_arguments
from ctxrl.tools.calculator import CalculatorError, calculate, calculator_tool, format_number, safe_eval
from ctxrl.tools.python import python_tool
from ctxrl.tools.sandbox import SandboxError, SandboxPool, SandboxResult, run_python, run_python_async

__all__ = [
    "CalculatorError",
    "SandboxError",
    "SandboxPool",
    "SandboxResult",
    "Tool",
    "calculate",
    "calculator_tool",
    "execute_tool_calls",
    "format_number",
    "python_tool",
    "run_python",
    "run_python_async",
    "safe_eval",
    "schema_problems",
    "validate_arguments",
]
