"""What ctxrl finds out about a chat template by rendering through it, before it trusts the template.

Two probes of the template alone, each run once by the renderer on first need: does it render ``tools``
at all (``ignores_tools``; SmolLM2's plain ChatML renders the same text with and without them), and can
it take a system turn (``system_turn_problem``; Gemma's raises on one). And the start-up checks of
incremental rendering through a ``ChatRenderer`` (``ctxrl.chat.render``), on a canned tool conversation
written as the policy's family writes it (``canned_conversation``):

- ``verify_prefix_preserving``: incremental rendering equals whole rendering within one tool exchange,
  else ``TemplateError`` naming the template (``prefix_message``);
- ``rewrites_history``: whether the template renders earlier turns differently once a new user message
  follows them (Qwen3's drops earlier reasoning), which cuts episodes into segments.

What this file does not do: decide what follows from a probe (the renderer writes the tools into the
system turn; the trainer checks that a run can train segments).
"""

from __future__ import annotations

from typing import Any

import jinja2

from ctxrl.chat.errors import HistoryRewritten, TemplateError
from ctxrl.chat.formats import with_prose
from ctxrl.types import Message, ToolCall

PROBE_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
"""The one tool of the renderer's checks: does the template render tools, and is it prefix-preserving."""
_PROBE_SYSTEM = "ctxrl probes whether this template prints the system turn."


def _apply(tokenizer: Any, chat: list[dict[str, Any]], tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)


def ignores_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's template renders a conversation with tools as it renders it without."""
    probe = [{"role": "user", "content": "Find the value of key a."}]
    return _apply(tokenizer, probe, PROBE_TOOLS) == _apply(tokenizer, probe, None)


def system_turn_problem(tokenizer: Any) -> str:
    """Why the tokenizer's template cannot take a system turn ("" when it prints a system message's content)."""
    chat = [{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": "Hello."}]
    try:
        printed = _PROBE_SYSTEM in _apply(tokenizer, chat, None)
        return "" if printed else "it drops the system message's content"
    except jinja2.TemplateError as exc:
        return f"it raises {str(exc)!r} on a system message"


def prefix_message(template_name: str) -> str:
    """What a template that is not prefix-preserving within a tool exchange gets told."""
    return (f"chat template {template_name!r} is not prefix-preserving for tool conversations: "
            "rendering more messages changes the text of earlier ones within one tool exchange (tool "
            "results, no new user message), so ctxrl cannot append new turns without re-tokenizing. "
            "ctxrl starts a new segment where a template rewrites history at a new user message (as "
            "Qwen3's drops earlier reasoning), but not on every turn: each turn would re-encode the whole "
            "conversation. Use a template that renders assistant turns verbatim "
            "(set model.chat_template to a Jinja file).")


def canned_conversation(renderer: Any) -> list[Message]:
    """The tool conversation ``verify_prefix_preserving`` plays, written as the policy's family writes it.

    Calls are in ``renderer``'s format (without one, the turns are prose); a template that knows
    ``<think>`` gets turns that open with a reasoning block, as a thinking model writes them.
    """
    think = "<think>\nThe key comes first.\n</think>\n\n" if "<think>" in renderer.template_text else ""

    def call(key: str, prose: str = "") -> str:
        if not renderer.has_tool_format:
            return think + (prose or f"Key {key}.")
        return think + with_prose(prose, renderer.tool_format.render([ToolCall("lookup", {"key": key})]))

    return [
        Message("system", "You are a careful agent."),
        Message("user", "Find the value of key a."),
        Message("assistant", call("a", "Looking it up.")),
        Message("tool", "b", name="lookup"),
        Message("assistant", call("b")),
        Message("tool", "42", name="lookup"),
        Message("assistant", think + "The value is 42."),
    ]


def rewrites_history(renderer: Any) -> bool:
    """Whether ``renderer``'s template renders earlier turns differently once a new user message follows them.

    Such a template (Qwen3's drops earlier reasoning) cuts an episode into segments wherever the
    conversation gets a user message: a reflection request, a summary request, an environment
    that replies as the user. The trainer checks at start-up that the run can train segments.
    """
    convo = canned_conversation(renderer)
    try:
        renderer.continuation_ids(convo, [Message("user", "And the value of key c?")], None)
    except HistoryRewritten:
        return True
    return False


def verify_prefix_preserving(renderer: Any) -> None:
    """Raise ``TemplateError`` unless ``renderer``'s incremental rendering equals its whole rendering within a
    tool exchange: the canned conversation played turn by turn, as an episode's ``Recorder`` plays one."""
    tools = PROBE_TOOLS
    convo = canned_conversation(renderer)
    ids = renderer.prompt_ids(convo[:2], tools)
    for k, message in enumerate(convo[2:], start=2):
        if message.role == "assistant":
            ids += renderer.assistant_ids(message.content)
            history_end = k + 1
            new = []
            for later in convo[history_end:]:
                if later.role == "assistant":
                    break
                new.append(later)
            if new:
                ids += renderer.continuation_ids(convo[:history_end], new, tools)
    whole = renderer.encode(renderer.text(convo, tools, add_generation_prompt=False))
    # The whole rendering ends with the template's tail after the last eos (e.g. "\n").
    if ids != whole[: len(ids)]:
        raise TemplateError(prefix_message(renderer.template_name)
                            + f" (first mismatch at token {_first_diff(ids, whole)})")
    trailing = renderer.decode(whole[len(ids):])
    if trailing.strip():
        raise TemplateError(prefix_message(renderer.template_name) + f" (unexpected trailing text {trailing!r})")


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
