"""Tools agents call: the ``Tool`` type, turn-level execution, and built-in tools."""

from ctxrl.tools.base import Tool, execute_tool_calls, schema_problems, validate_arguments
from ctxrl.tools.calculator import CalculatorError, calculate, calculator_tool, format_number, safe_eval

__all__ = [
    "CalculatorError",
    "Tool",
    "calculate",
    "calculator_tool",
    "execute_tool_calls",
    "format_number",
    "safe_eval",
    "schema_problems",
    "validate_arguments",
]
