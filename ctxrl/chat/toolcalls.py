"""Hermes / Qwen tool calls, the format environments write their scripted solutions in.

These are thin wrappers over the ``hermes`` format (``ctxrl.chat.formats.hermes``): environments
write gold turns with ``format_tool_call`` whatever the policy's family, and the scripted engine
rewrites them into the renderer's format (``ctxrl.engine.scripted``). To parse what a policy
sampled, use its renderer's format (``ChatRenderer.parse_assistant``), not these.

An assistant message calls tools with blocks like::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 + 4"}}
    </tool_call>

Parsing never raises: a block that is not valid JSON, lacks ``name``/``arguments``, or is left
unclosed becomes an error string, which the agent loop shows to the model as an observation
(the episode continues) and counts.
"""

from __future__ import annotations

from ctxrl.chat.formats.base import parse_assistant as _parse_assistant
from ctxrl.chat.formats.hermes import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    Hermes,
    format_call,
)
from ctxrl.types import Message, ToolCall

__all__ = ["HERMES", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "TOOL_RESPONSE_CLOSE", "TOOL_RESPONSE_OPEN",
           "content_without_tool_calls", "format_tool_call", "parse_assistant", "parse_tool_calls"]

HERMES = Hermes()


def format_tool_call(name: str, arguments: dict) -> str:
    """The exact text a Hermes/Qwen model writes to call ``name`` with ``arguments``."""
    return format_call(name, arguments)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Return ``(calls, errors)`` found in ``text``; errors describe malformed blocks."""
    return HERMES.parse(text)


def content_without_tool_calls(text: str) -> str:
    """The free text of an assistant message with its tool-call blocks removed."""
    return HERMES.content_without_calls(text)


def parse_assistant(text: str) -> Message:
    """Turn sampled Hermes assistant text into a ``Message`` with parsed calls and parse errors."""
    return _parse_assistant(HERMES, text)
