"""What an MCP tool looks like to the policy: its name, its schema, and its result as observation text.

``exposed_name``: ctxrl's tool names are 1-64 letters, digits, ``_`` or ``-`` (what every tool-call format can
write); an MCP name with other characters (``files.read``) is shown with ``_`` in their place, and calls go to the
server under its own name. ``clean_schema``: the server's input schema as given, less the ``title`` entries that
pydantic writes into every schema (``"title": "addArguments"``, ``"title": "A"``): they say nothing the name does
not, and every prompt pays for them. ``result_text``: a ``tools/call`` result as one text (see its docstring).

Nothing here imports the ``mcp`` package: results are read by their fields, so these functions are tested on
plain stand-ins as well as on the package's own types.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ctxrl.chat.surrogates import replace_surrogates
from ctxrl.tools.base import ToolFailed

MAX_OUTPUT_CHARS = 16_000
"""An observation longer than this is cut, with a note saying how long it was (a server that returns a whole file
would otherwise fill the episode's ``rollout.max_total_tokens`` in one turn)."""

_INVALID = re.compile(r"[^A-Za-z0-9_-]")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
"""Keywords whose value maps names to schemas (the names are data, never keywords)."""
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def exposed_name(name: str) -> str:
    """The name the policy sees for the MCP tool ``name`` (see the module docstring)."""
    return _INVALID.sub("_", name)[:64] or "tool"


def clean_schema(schema: Any) -> Any:
    """``schema`` without the ``title`` keyword at any depth (a property *named* ``title`` stays)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: clean_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [clean_schema(sub) for sub in value]
        elif key in _SCHEMA_VALUES:
            value = [clean_schema(sub) for sub in value] if isinstance(value, list) else clean_schema(value)
        out[key] = value
    return out


def result_text(result: Any, limit: int = MAX_OUTPUT_CHARS) -> str:
    """A ``tools/call`` result as the observation: its text blocks joined by newlines, a line in brackets for each
    block a text model cannot read (an image, audio, a binary resource), the structured content as JSON when there
    is nothing else; cut at ``limit`` characters. A result the server marks ``isError`` raises ``ToolFailed`` with
    that text, which ``execute_tool_calls`` makes an ``Error: tool NAME failed: ...`` observation."""
    text = "\n".join(filter(None, (_block_text(block) for block in getattr(result, "content", None) or [])))
    text = replace_surrogates(text)  # (JSON can carry a lone surrogate; no tokenizer takes one)
    structured = getattr(result, "structured_content", None)
    if not text and structured is not None:
        text = json.dumps(structured, ensure_ascii=False)
    if len(text) > limit:
        text = f"{text[:limit]}\n[output cut at {limit} of {len(text)} characters]"
    if getattr(result, "is_error", False):
        raise ToolFailed(text or "the server reported an error without a message")
    return text or "[no output]"


def _block_text(block: Any) -> str:
    kind = getattr(block, "type", "")
    if kind == "text":
        return block.text
    if kind in ("image", "audio"):
        return f"[{kind} {block.mime_type}, {len(block.data) * 3 // 4} bytes, not shown]"
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        if text is not None:
            return text
        return f"[resource {resource.uri} ({getattr(resource, 'mime_type', None) or 'binary'}), not shown]"
    if kind == "resource_link":
        return f"[resource {block.uri}]"
    return f"[{kind or type(block).__name__} content, not shown]"
