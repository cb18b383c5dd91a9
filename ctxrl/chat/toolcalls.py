"""Tool calls in the Hermes / Qwen format: write them and parse them from sampled text.

An assistant message calls tools with blocks like::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 + 4"}}
    </tool_call>

Parsing never raises: a block that is not valid JSON, lacks ``name``/``arguments``, or is left
unclosed becomes an error string, which the agent loop shows to the model as an observation
(the episode continues) and counts.
"""

from __future__ import annotations

import json
import re

from ctxrl.types import Message, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def format_tool_call(name: str, arguments: dict) -> str:
    """The exact text a model should write to call ``name`` with ``arguments``."""
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Return ``(calls, errors)`` found in ``text``; errors describe malformed blocks."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    last_end = 0
    for match in _BLOCK.finditer(text):
        last_end = match.end()
        body = match.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"malformed tool call: invalid JSON ({exc.msg} at char {exc.pos}); "
                          'write {"name": ..., "arguments": {...}} inside <tool_call></tool_call>')
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append('malformed tool call: expected a JSON object with a string "name"')
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some models emit arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f'malformed tool call to {obj["name"]!r}: "arguments" must be a JSON object')
            continue
        calls.append(ToolCall(name=obj["name"], arguments=arguments))
    # An opening tag with no closing tag after the last complete block.
    if TOOL_CALL_OPEN in text[last_end:]:
        errors.append("malformed tool call: <tool_call> was not closed with </tool_call>")
    return calls, errors


def content_without_tool_calls(text: str) -> str:
    """The free text of an assistant message with its tool-call blocks removed."""
    return _BLOCK.sub("", text).strip()


def parse_assistant(text: str) -> Message:
    """Turn sampled assistant text into a ``Message`` with parsed calls and parse errors."""
    calls, errors = parse_tool_calls(text)
    return Message(role="assistant", content=text, tool_calls=calls, tool_call_errors=errors)
