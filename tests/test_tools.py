"""Tools: the safe calculator and turn-level execution, where every model error is an observation."""

from __future__ import annotations

import asyncio
import re

import pytest

from ctxrl.chat.toolcalls import parse_assistant
from ctxrl.config import ConfigError, load_config
from ctxrl.tools import CalculatorError, Tool, calculate, calculator_tool, execute_tool_calls, safe_eval
from ctxrl.tools.base import schema_problems, validate_arguments
from ctxrl.types import Message, ToolCall


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("37 + 58 * 4", "269"),
        ("(37 + 58) * 4", "380"),
        ("10 - 2 - 3", "5"),
        ("-3 + +5", "2"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("1 / 3", "0.333333"),
        ("2 / 3", "0.666667"),
        ("7 // 2", "3"),
        ("7 % 4", "3"),
        ("1.5 * 2", "3"),
        ("  12  ", "12"),
    ],
)
def test_calculator_accepts_arithmetic(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "unsupported"),
        ("x + 1", "unsupported syntax (Name)"),
        ("2 ** 10", "'**' is not supported"),
        ("1 < 2", "unsupported"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1 +", "could not parse"),
        ("", "empty expression"),
        ("9" * 40, "too large"),
        ("99999999999 * 99999999999 * 99999999999", "too large"),
        ("1" + " + 1" * 200, "longer than"),
        ("1e308 * 10", "too large"),
    ],
)
def test_calculator_rejects_everything_else(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=re.escape(message)):
        safe_eval(expression)


def test_calculator_tool_schema() -> None:
    schema = calculator_tool().schema()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert schema_problems(schema["function"]["parameters"]) == []


def test_schema_problems_and_tool_construction() -> None:
    assert schema_problems({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]})
    assert schema_problems({"type": "array"})
    with pytest.raises(ValueError, match="invalid parameters schema"):
        Tool("t", "d", {"type": "string"}, fn=lambda: "x")
    with pytest.raises(ValueError, match="tool name"):
        Tool("bad name!", "d", {"type": "object", "properties": {}}, fn=lambda: "x")


def test_validate_arguments_names_the_field() -> None:
    params = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "unit": {"type": "string", "enum": ["a", "b"]},
                       "x": {"type": ["number", "null"]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    assert validate_arguments(params, {"n": 3}) is None
    assert validate_arguments(params, {"n": 3.0, "x": None}) is None
    assert "missing required argument 'n'" in validate_arguments(params, {})
    assert "'n' must be integer, got string" in validate_arguments(params, {"n": "3"})
    assert "'n' must be integer, got boolean" in validate_arguments(params, {"n": True})
    assert "'unit' must be one of" in validate_arguments(params, {"n": 1, "unit": "c"})
    assert "unexpected argument 'zzz'" in validate_arguments(params, {"n": 1, "zzz": 1})
    assert "'x' must be number or null" in validate_arguments(params, {"n": 1, "x": "s"})


def _run(tools: list[Tool], message: Message) -> tuple[list[Message], dict]:
    return asyncio.run(execute_tool_calls(tools, message))


def test_execute_good_call() -> None:
    message = parse_assistant('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>')
    observations, counts = _run([calculator_tool()], message)
    assert [(m.role, m.name, m.content) for m in observations] == [("tool", "calculator", "5")]
    assert counts == {"tool_calls": 1, "tool_errors": 0, "malformed_tool_calls": 0}


def test_execute_malformed_unknown_and_schema_violation() -> None:
    text = (
        "<tool_call>\n{not json}\n</tool_call>"
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "x"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    )
    observations, counts = _run([calculator_tool()], parse_assistant(text))
    contents = [m.content for m in observations]
    assert len(observations) == 6 and all(m.role == "tool" for m in observations)
    assert observations[0].name is None and contents[0].startswith("Error: malformed tool call")
    assert "unknown tool 'search'" in contents[1] and "available tools: calculator" in contents[1]
    assert "missing required argument 'expression'" in contents[2]
    assert "'expression' must be string, got integer" in contents[3]
    assert contents[4].startswith("Error: tool calculator raised CalculatorError: unsupported syntax")
    assert contents[5] == "42"
    assert counts == {"tool_calls": 6, "tool_errors": 5, "malformed_tool_calls": 1}


def test_execute_exception_and_timeout() -> None:
    params = {"type": "object", "properties": {}}

    def boom() -> str:
        raise RuntimeError("disk on fire")

    async def slow() -> str:
        await asyncio.sleep(1.0)
        return "late"

    async def quick() -> str:
        return "ok"

    tools = [Tool("boom", "raises", params, boom), Tool("slow", "hangs", params, slow, timeout_s=0.01),
             Tool("quick", "fast async", params, quick), Tool("number", "non-str", params, lambda: 3)]
    calls = [ToolCall(n, {}) for n in ("boom", "slow", "quick", "number")]
    message = Message(role="assistant", content="", tool_calls=calls)
    observations, counts = _run(tools, message)
    assert [m.content for m in observations] == [
        "Error: tool boom raised RuntimeError: disk on fire",
        "Error: tool slow timed out after 0.01s",
        "ok",
        "3",
    ]
    assert [m.name for m in observations] == ["boom", "slow", "quick", "number"]
    assert counts == {"tool_calls": 4, "tool_errors": 2, "malformed_tool_calls": 0}


def test_execute_without_calls_is_empty() -> None:
    observations, counts = _run([calculator_tool()], Message(role="assistant", content="<answer>3</answer>"))
    assert observations == [] and counts == {"tool_calls": 0, "tool_errors": 0, "malformed_tool_calls": 0}


def test_a_sync_tool_past_its_timeout_holds_up_neither_the_step_nor_the_exit():
    """A 4 s sync tool with a 0.3 s timeout: the timeout observation comes within timeout + 1 s, the event
    loop closes at once (the abandoned call runs on in a daemon thread), and the process exits promptly."""
    import subprocess
    import sys
    import time

    slow = Tool("slow", "Sleep.", {"type": "object", "properties": {}}, lambda: time.sleep(4) or "late",
                timeout_s=0.3)
    started = time.monotonic()
    observations, counts = asyncio.run(execute_tool_calls([slow], Message("assistant", "", [ToolCall("slow", {})])))
    assert time.monotonic() - started < 1.3  # asyncio.run included: nothing waited for the thread
    assert "timed out after 0.3s" in observations[0].content and counts["tool_errors"] == 1
    script = ("import asyncio, time\n"
              "from ctxrl.tools.base import Tool, execute_tool_calls\n"
              "from ctxrl.types import Message, ToolCall\n"
              "hang = Tool('hang', 'Hang.', {'type': 'object', 'properties': {}}, lambda: time.sleep(3600),\n"
              "            timeout_s=0.3)\n"
              "call = Message('assistant', '', [ToolCall('hang', {})])\n"
              "print(asyncio.run(execute_tool_calls([hang], call))[0][0].content)\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "timed out" in proc.stdout, proc.stderr
    assert time.monotonic() - started < 20  # a hanging tool never keeps the process alive (imports take seconds)


def test_the_python_tool_runs_through_a_bounded_pool(monkeypatch):
    from ctxrl.tools import python as python_module
    from ctxrl.tools import sandbox
    from ctxrl.tools.sandbox import SandboxResult

    live = {"now": 0, "most": 0}

    async def fake_run(code, **limits):
        live["now"] += 1
        live["most"] = max(live["most"], live["now"])
        await asyncio.sleep(0.05)
        live["now"] -= 1
        return SandboxResult(stdout=code, stderr="", exit_code=0, timed_out=False, memory_exceeded=False,
                             truncated=False, duration_s=0.05)

    monkeypatch.setattr(sandbox, "run_python_async", fake_run)
    monkeypatch.setattr(python_module, "_POOL", python_module._POOL)
    python_module.configure_pool(2)
    tool = python_module.python_tool()

    async def many():
        return await asyncio.gather(*(tool(code=f"print({i})") for i in range(7)))

    assert asyncio.run(many()) == [f"print({i})" for i in range(7)]
    assert live["most"] == 2 and python_module.pool().workers == 2
    with pytest.raises(ConfigError, match="rollout.sandbox_workers must be > 0"):
        load_config(None, ["rollout.sandbox_workers=0"])
