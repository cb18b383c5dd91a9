"""The tool-call format protocol: how one model family writes tool calls, read and written back.

A format is a small class with a ``name`` and three methods, registered by name
(``@register_format``, into ``FORMATS``; ``ctxrl.chat.formats`` names the built-ins):

- ``parse(text) -> (calls, errors)``: the calls an assistant wrote, in order, and one error
  sentence per malformed call. It never raises: whatever the model wrote is data. An error starts
  with ``malformed tool call`` and says what was expected, because the agent loop shows it to the
  model as the call's observation (``ctxrl.tools.base.execute_tool_calls``);
- ``render(calls) -> str``: the exact text a model of the family writes for ``calls`` (scripted
  demonstrations are written with it), which ``parse`` reads back as ``calls``;
- ``content_without_calls(text) -> str``: the prose around the calls.

``markers`` are pieces of chat-template text that ask for the format; ``model.tool_format =
"auto"`` picks the first registered format whose marker the template contains. ``call_tags`` and
``result_tags`` are the format's structure strings, which text the framework did not lay out cannot
make (``ctxrl.chat.guard``); a format without tags (``pythonic``) has empty ones.

A call is data whatever the policy wrote in it: a lone surrogate (``"\\ud800"``, valid JSON but no text) is
U+FFFD in the parsed call (``tool_call``, ``ctxrl.chat.surrogates``), and JSON nested deeper than Python reads is a
malformed call (``json_error``), never an exception that stops the run.

What a format deliberately does not do: decide what a call means (the environment's tools do,
with their schemas) or render conversations (the chat template does).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, Protocol, TypeVar

from ctxrl.chat.surrogates import replace_surrogates, without_surrogates
from ctxrl.errors import ConfigError
from ctxrl.registry import Registry
from ctxrl.types import Message, ToolCall

MALFORMED = "malformed tool call"
"""How every parse error starts, so that a reader (or a test) can tell them from a tool's own errors."""


class ToolFormat(Protocol):
    """One family's way of writing tool calls (see the module docstring)."""

    name: ClassVar[str]
    families: ClassVar[str]
    """The model families that write it, for docs and error messages."""
    markers: ClassVar[tuple[str, ...]]
    """Chat-template text that asks for this format (``auto``)."""
    example: ClassVar[str]
    """One call as the family writes it, for error messages and docs."""
    call_tags: ClassVar[tuple[str, ...]]
    """What opens, closes or separates calls in an assistant turn (``<tool_call>``, ``[TOOL_CALLS]``): the
    assistant's own structure there, plain text in any other text (``ctxrl.chat.guard``)."""
    result_tags: ClassVar[tuple[str, ...]]
    """What the family's templates frame tool results with (``<tool_response>``): plain text in any message."""

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]: ...

    def render(self, calls: list[ToolCall]) -> str: ...

    def content_without_calls(self, text: str) -> str: ...


FORMATS: Registry[type[ToolFormat]] = Registry("tool format", entry_point_group="ctxrl.tool_formats",
                                               error=ConfigError)
"""The formats by name; the built-ins, which import this module, are named by ``ctxrl.chat.formats``."""

F = TypeVar("F", bound=type)


def register_format(cls: F) -> F:
    """Class decorator: make ``model.tool_format = cls.name`` choose ``cls``."""
    if not getattr(cls, "name", ""):
        raise ValueError(f"{cls.__qualname__} needs a class attribute name to register as a tool format")
    return FORMATS.register(cls.name, cls)


def gather(scanned) -> tuple[list[ToolCall], list[str]]:
    """The calls and parse errors of ``(start, end, calls, errors)`` spans, in order (a format's ``parse``)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for _, _, found, problems in scanned:
        calls.extend(found)
        errors.extend(problems)
    return calls, errors


def without_spans(text: str, scanned) -> str:
    """``text`` with the ``(start, end, calls, errors)`` spans cut out, stripped (a format's prose around its calls)."""
    pieces, last = [], 0
    for start, end, _, _ in scanned:
        pieces.append(text[last:start])
        last = end
    pieces.append(text[last:])
    return "".join(pieces).strip()


def parse_assistant(tool_format: ToolFormat, text: str) -> Message:
    """Sampled assistant text as a ``Message``: the raw text as content, with its parsed calls and parse errors."""
    calls, errors = tool_format.parse(text)
    return Message(role="assistant", content=text, tool_calls=calls, tool_call_errors=errors)


def with_prose(prose: str, calls_text: str) -> str:
    """An assistant text of some prose followed by its calls (the prose on its own line(s))."""
    prose = prose.strip()
    if not calls_text:
        return prose
    return f"{prose}\n{calls_text}" if prose else calls_text


def call_id(name: str, arguments: dict[str, Any], index: int) -> str:
    """A deterministic tool-call id of 9 letters and digits (Mistral's rule) for the ``index``-th call of a message.

    The same call at the same place always gets the same id, so that rendering a conversation
    twice gives the same text; two identical calls at the same place of two turns share it.
    """
    key = json.dumps([name, arguments, index], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:9]  # (a call built by hand may hold one)


def tool_call(name: str, arguments: dict[str, Any], id: str | None = None) -> ToolCall:
    """A parsed call, every string in it text: a lone surrogate the policy wrote as an escape is U+FFFD."""
    return ToolCall(name=replace_surrogates(name), arguments=without_surrogates(arguments),
                    id=None if id is None else replace_surrogates(id))


def arguments_of(name: str, arguments: Any, key: str = "arguments") -> tuple[dict[str, Any] | None, str | None]:
    """A call's arguments as a dict, or an error: a JSON string holding an object is decoded first
    (some models write ``"arguments": "{\\"x\\": 1}"``)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return None, f'{MALFORMED} to {name!r}: "{key}" must be a JSON object'
    return arguments, None


def json_error(exc: json.JSONDecodeError | RecursionError, what: str) -> str:
    """A parse error for invalid JSON (or JSON nested deeper than Python reads), saying where and what was expected."""
    if isinstance(exc, RecursionError):
        return f"{MALFORMED}: invalid JSON (nested too deeply to read); {what}"
    return f"{MALFORMED}: invalid JSON ({exc.msg} at char {exc.pos}); {what}"


def rewrite_calls(text: str, target: ToolFormat, source: ToolFormat) -> str:
    """``text`` with the calls ``source`` finds in it written the way ``target`` writes them, the prose kept before.

    For scripted demonstrations, which environments write in the Hermes format. A text without
    calls, a text with a malformed call (it has no meaning to carry over) and a text whose formats
    agree come back unchanged.
    """
    if target.name == source.name:
        return text
    calls, errors = source.parse(text)
    if not calls or errors:
        return text
    return with_prose(source.content_without_calls(text), target.render(calls))

