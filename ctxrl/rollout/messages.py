"""Small helpers that build conversations from others: what a restarted sequence opens with.

Context managers (a summary's restart, a fold branch), the meta loop (notes from earlier
attempts) and annealed demonstrations all open a new sequence from the episode's opening with
something written into the task; ``task_with`` is that one operation. ``text_only`` is how an
earlier assistant message is shown again: from its text alone.
"""

from __future__ import annotations

import dataclasses

from ctxrl.types import Message


def task_with(opening: list[Message], header: str, text: str) -> list[Message]:
    """The opening system message, then the task (the first user message) with ``header`` + ``text`` appended."""
    system = [m for m in opening if m.role == "system"]
    task = next((m for m in opening if m.role == "user"), None)
    if task is None:
        raise ValueError("the episode's opening messages have no user message (the task) to start a sequence from")
    return [*system[:1], Message(role="user", content=task.content + header + text.strip())]


def text_only(message: Message) -> Message:
    """An assistant message re-rendered from its text alone (``tool_calls`` cleared).

    Its text already holds the calls (ctxrl keeps the raw sampled text), and templates that also
    render ``tool_calls`` would show them twice. Other messages are returned as they are.
    """
    if message.role != "assistant":
        return message
    return dataclasses.replace(message, tool_calls=[], tool_call_errors=[])
