"""The system-turn text that tells a policy its tools, for chat templates that ignore ``tools``.

Qwen's and Hermes' chat templates list the tools' JSON schemas in the system turn and say how to
call one. Many small models ship a plain ChatML template that ignores the ``tools`` argument of
``apply_chat_template`` (SmolLM2-135M-Instruct's): a policy trained through it would never be told
what it can call. For such a template ``ChatRenderer`` writes this text into the system turn itself
(``ctxrl.chat.render``).

The calling convention is shown rather than described: one call to the first tool, written by the
tool-call format's own ``render``. Every registered format, and any added later, so explains itself,
and the format's ``parse`` reads the example back as the call it shows.

The text goes into the system turn (``in_system_turn``): appended to the conversation's system message,
or as a system message of its own.

What this file does not do: decide whether a template needs the text (the renderer does, probing the
template once: ``ctxrl.chat.checks.ignores_tools``), or reproduce any family's wording (it is written
for ctxrl).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from ctxrl.chat.formats.base import ToolFormat
from ctxrl.types import Message, ToolCall

PLACEHOLDERS: dict[str, Any] = {"string": "...", "integer": 0, "number": 0, "boolean": False, "array": [],
                                "object": {}, "null": None}
"""The value the example call gives a parameter of each JSON type."""


def tools_system_text(tools: list[dict], tool_format: ToolFormat) -> str:
    """The text that lists ``tools`` (OpenAI-style schemas, as ``apply_chat_template`` takes them) and shows
    how to call one in ``tool_format``: a ``# Tools`` header, each schema as JSON on its own line inside
    ``<tools></tools>``, then an example call written by ``tool_format.render``."""
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    call = example_call(tools)
    return ("# Tools\n\n"
            "You can call the tools below. Each line between <tools></tools> is one tool's JSON schema.\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            f"To call a tool, write the call in exactly this form (here {call.name}, with placeholder arguments):\n"
            f"{tool_format.render([call])}\n\n"
            "Each result comes back to you in the next message.")


def in_system_turn(messages: list[Message], text: str) -> list[Message]:
    """``messages`` with ``text`` in the system turn: appended to the first message's content when that is a
    system message (a blank line between), else as a system message put first."""
    if messages and messages[0].role == "system":
        first = messages[0]
        content = f"{first.content}\n\n{text}" if first.content else text
        return [dataclasses.replace(first, content=content), *messages[1:]]
    return [Message("system", text), *messages]


def example_call(tools: list[dict]) -> ToolCall:
    """A call to the first tool: each required parameter (every parameter, when none is required) with a
    placeholder of its type (its first ``enum`` value, when it lists some)."""
    function = _function(tools[0])
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    names = parameters.get("required") or list(properties)
    return ToolCall(function["name"], {name: _placeholder(properties.get(name) or {}) for name in names})


def _function(tool: dict) -> dict:
    """A tool's function schema: ``{"type": "function", "function": {...}}`` or the function schema itself."""
    return tool["function"] if isinstance(tool.get("function"), dict) else tool


def _placeholder(schema: dict) -> Any:
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "string")
    if isinstance(kind, list):  # ["string", "null"]: the first type
        kind = kind[0] if kind else "string"
    return copy.deepcopy(PLACEHOLDERS.get(kind, "..."))  # a list or dict of its own, not the shared one
