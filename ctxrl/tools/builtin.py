"""The built-in tools by name: what ``env.tools`` names (``jsonl_tools``) and ``ctxrl mcp-serve`` serves.

Each name maps to the function that builds a fresh ``Tool`` with its default limits. The environments that
build their own tools (``search_qa``'s search over its knowledge base, ``sokoban``'s moves) are not here:
those tools are bound to an episode's world.
"""

from __future__ import annotations

from collections.abc import Callable

from ctxrl.tools.base import Tool


def _calculator() -> Tool:
    from ctxrl.tools.calculator import calculator_tool

    return calculator_tool()


def _python() -> Tool:
    from ctxrl.tools.python import python_tool

    return python_tool()


BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"calculator": _calculator, "python": _python}


def builtin_tool(name: str) -> Tool:
    """A new built-in tool ``name``; a ``KeyError`` naming the built-in tools for any other name."""
    if name not in BUILTIN_TOOLS:
        raise KeyError(f"unknown tool {name!r}; built-in tools are {', '.join(BUILTIN_TOOLS)}")
    return BUILTIN_TOOLS[name]()


def builtin_tools(names: str) -> list[Tool]:
    """The built-in tools of a comma-separated list (``"calculator,python"``; empty: none), in its order."""
    return [builtin_tool(n) for n in parse_names(names)]


def parse_names(names: str) -> tuple[str, ...]:
    """The names of a comma-separated list, stripped, empty entries left out."""
    return tuple(n.strip() for n in names.split(",") if n.strip())
