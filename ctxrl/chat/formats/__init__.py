"""Tool-call formats by name, and the automatic choice from a chat template (docs/tool-formats.md).

Each model family writes tool calls its own way; a format reads them from sampled text and
writes them for scripted demonstrations (``ctxrl.chat.formats.base``):

- ``hermes``: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3, Hermes);
- ``mistral``: ``[TOOL_CALLS] [{"name": "f", "arguments": {...}, "id": ...}]`` (Mistral, Mixtral);
- ``pythonic``: ``[f(x=1, y='a')]`` (Llama 3.2, Llama 4);
- ``llama3_json``: ``{"name": "f", "parameters": {...}}`` (Llama 3.1, Llama 3.3).

``model.tool_format = "auto"`` (the default) picks the first format, in that order, whose marker
the chat template contains (``<tool_call>``; ``[TOOL_CALLS]``; a ``[func_name(...)]`` example;
``<|python_tag|>`` or ``ipython``). A template that shows none of them but is ChatML (it opens turns
with ``<|im_start|>``, as SmolLM2's plain template does) gets ``hermes``, the format ChatML families
write (the renderer says so in its ``notices``). Any other template without a marker gets no format:
a conversation without tools still renders, and one with tools is refused with a message naming the
choices (``ChatRenderer.tool_format``).
"""

from __future__ import annotations

from ctxrl.chat.formats.base import (
    FORMATS,
    MALFORMED,
    ToolFormat,
    call_id,
    parse_assistant,
    register_format,
    rewrite_calls,
    with_prose,
)

FORMATS.add_builtins(
    # The order is the order ``auto`` tries: a pythonic Llama template also mentions ``ipython``, so pythonic
    # is tried before llama3_json.
    "ctxrl.chat.formats.hermes", "ctxrl.chat.formats.mistral", "ctxrl.chat.formats.pythonic",
    "ctxrl.chat.formats.llama3_json")

__all__ = ["CHATML", "CHATML_FORMAT", "FORMATS", "MALFORMED", "ToolFormat", "call_id", "choose_format",
           "detect_format", "format_names", "get_format", "markers_text", "parse_assistant", "register_format",
           "rewrite_calls", "with_prose"]


def format_names() -> list[str]:
    """The names ``model.tool_format`` accepts besides ``auto``, in the order ``auto`` tries them.

    Built-ins first, in the order of ``FORMATS.builtins`` (whose modules are named after their
    formats), whatever order they were imported in; then formats of other packages.
    """
    builtin = [module.rsplit(".", 1)[1] for module in FORMATS.builtins]
    return sorted(FORMATS.names(), key=lambda name: builtin.index(name) if name in builtin else len(builtin))


def get_format(name: str) -> ToolFormat:
    """The format registered as ``name`` (an unknown name is a ``ConfigError`` listing the known ones)."""
    return FORMATS.get(name)()


def detect_format(template: str) -> ToolFormat | None:
    """The first format whose marker ``template`` (chat-template text) contains, or None."""
    for name in format_names():
        cls = FORMATS.get(name)
        if any(marker in template for marker in cls.markers):
            return cls()
    return None


CHATML = "<|im_start|>"
"""What marks a ChatML template, which ``auto`` gives ``CHATML_FORMAT`` when it shows no format's marker."""
CHATML_FORMAT = "hermes"
"""The format ChatML families (Qwen, Hermes) write, for ChatML templates that show none."""


def choose_format(requested: str, template: str) -> ToolFormat | None:
    """``requested`` (a name, or ``auto`` to read ``template``) as a format; None when ``auto`` finds none.

    ``auto`` on a ChatML template without markers is ``CHATML_FORMAT`` (see the module docstring).
    """
    if requested != "auto":
        return get_format(requested)
    found = detect_format(template)
    if found is None and CHATML in template:
        return get_format(CHATML_FORMAT)
    return found


def markers_text() -> str:
    """What ``auto`` looks for, per format, for error messages."""
    return "; ".join(f"{' or '.join(FORMATS.get(n).markers)} ({n})" for n in format_names())
