"""Context managers: what the model sees before each generation when an episode outgrows its budget.

- ``full`` (default): the whole history, always (the baseline; ``max_total_tokens`` still caps it).
- ``window``: when the next generation would not fit in ``max_context_tokens``, the oldest whole
  turns (an assistant message with the observations that answered it) are dropped: a new segment
  starts from the opening messages and the most recent turns that fit, rendered as a fresh
  prompt. Nothing is sampled to make it (the baseline ``summarize`` must beat).
- ``fold`` (Context-Folding): two more tools, ``branch(goal)`` and ``return(result)``. A branch
  runs as its own segment from a short context (the opening system message and the task, with
  the goal appended); on ``return`` only the result comes back to the parent, as the branch
  call's tool response, and the parent goes on. The branch's tokens never enter the parent's
  context. One level of branching; ``max_branches`` per episode. A branch segment ends as
  ``fold`` (it returned a result), ``fold-empty`` (it returned nothing) or ``fold-unfinished``
  (the episode ended first).
- ``summarize`` (SUPO / ReSum): at the end of a turn, if the next generation would not fit in
  ``max_context_tokens``, the environment's reply is followed by a summary instruction and the
  policy writes a summary (sampled, loss mask 1: trained end to end). The episode then continues
  in a new segment whose prompt is exactly the opening system message and the task, with the
  summary appended to the task (``restart_messages``), rendered as a fresh prompt. Every action
  turn is generated within the budget; the summary step itself may pass it by that one
  observation, the instruction and the summary. After ``max_summaries`` summaries an episode
  that still does not fit ends with truncation ``max_context``. Evaluation may allow more
  summaries than training (test-time scaling).

Each closed segment is kept in ``Episode.segments`` with its own ids, masks and behaviour
log-probs, so it trains as its own sequence; advantages are computed per episode and broadcast
to its segments (``ctxrl.train.segments``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ctxrl.types import Message

MANAGERS = ("full", "window", "summarize", "fold")
BRANCH_HEADER = "\n\nYour sub-task (work on it, then call return with its result):\n"
FOLD_TOOL_SCHEMAS = [
    {"type": "function", "function": {
        "name": "branch", "description": "Work on a sub-task in a fresh context; you get back only its result.",
        "parameters": {"type": "object", "properties": {"goal": {"type": "string"}}, "required": ["goal"]}}},
    {"type": "function", "function": {
        "name": "return", "description": "End the current sub-task and hand its result to the main task.",
        "parameters": {"type": "object", "properties": {"result": {"type": "string"}}, "required": ["result"]}}},
]
SUMMARY_INSTRUCTION = ("Your context is nearly full. Write a short summary of what you have found and what is "
                       "left to do; you will continue from it.")
SUMMARY_HEADER = "\n\nYour summary of the work so far:\n"
# The meta loop's request for a reflection on a finished attempt (ctxrl.rollout.meta), kept here with
# the other instructions so that the config can name it without importing the agent loop.
REFLECTION_INSTRUCTION = ("Reflect on this attempt in one or two sentences: what went wrong, and what will you do "
                          "differently next time?")


@dataclass(frozen=True)
class ContextPolicy:
    """How an episode's working context is managed (see the module docstring)."""

    manager: str = "full"
    max_context_tokens: int = 0
    """Working-context budget in tokens (``summarize``); 0 = unlimited."""
    max_summaries: int = 0
    """Summaries an episode may write before it ends with truncation ``max_context``."""
    summary_max_tokens: int = 64
    """Tokens one summary may take."""
    instruction: str = SUMMARY_INSTRUCTION
    max_branches: int = 4
    """Branches an episode may open (``fold``)."""

    def __post_init__(self) -> None:
        if self.manager not in MANAGERS:
            raise ValueError(f"context manager must be one of {', '.join(MANAGERS)}, not {self.manager!r}")
        if self.manager in ("window", "summarize") and self.max_context_tokens <= 0:
            raise ValueError(f"the {self.manager} context manager needs max_context_tokens > 0")

    def over_budget(self, context_tokens: int, next_turn_tokens: int) -> bool:
        """Whether a context of ``context_tokens`` leaves no room for a turn of ``next_turn_tokens``."""
        return (self.manager in ("window", "summarize")
                and context_tokens + next_turn_tokens > self.max_context_tokens)


def restart_messages(opening: list[Message], summary: str) -> list[Message]:
    """The conversation a new segment starts from: the opening system message, the task + the summary."""
    return _task_with(opening, SUMMARY_HEADER, summary)


def _task_with(opening: list[Message], header: str, text: str) -> list[Message]:
    """The opening system message, then the task (the first user message) with ``header`` + ``text`` appended."""
    system = [m for m in opening if m.role == "system"]
    task = next((m for m in opening if m.role == "user"), None)
    if task is None:
        raise ValueError("the episode's opening messages have no user message (the task) to start a segment from")
    return [*system[:1], Message(role="user", content=task.content + header + text.strip())]


def split_turns(messages: list[Message]) -> tuple[list[Message], list[list[Message]]]:
    """(the opening: up to the first user message, the turns after it: each an assistant message + replies)."""
    first_user = next((i for i, m in enumerate(messages) if m.role == "user"), None)
    if first_user is None:
        raise ValueError("a conversation to window needs a user message (the task)")
    head, turns = messages[: first_user + 1], []
    for m in messages[first_user + 1:]:
        if m.role == "assistant" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return head, turns


def window_messages(messages: list[Message], fits) -> list[Message] | None:
    """The opening plus the longest suffix of whole turns, at least one turn shorter, for which ``fits`` holds.

    The newest turn is always kept: it holds the observation the model has not seen yet. Kept
    assistant messages are re-rendered from their text alone (``tool_calls`` cleared): the text
    already holds the calls, and templates that also render ``tool_calls`` would show them twice.
    ``fits(candidate)`` says whether a prompt of these messages leaves room for the next turn.
    None when the opening and the newest turn alone do not fit.
    """
    head, turns = split_turns(messages)
    turns = [[dataclasses.replace(m, tool_calls=[], tool_call_errors=[]) if m.role == "assistant" else m for m in t]
             for t in turns]
    for start in range(1, len(turns)):
        candidate = head + [m for turn in turns[start:] for m in turn]
        if not candidate[-1].role == "assistant" and fits(candidate):
            return candidate
    return None


def scheduled_budget(step: int, *, final: int, start: int = 0, steps: int = 0) -> int:
    """The context budget at RL ``step`` under a shrinking-budget curriculum (BACM-style).

    Linear from ``start`` at step 0 to ``final`` at step ``steps``, then ``final``; ``start`` of 0
    (or ``steps`` of 0) means no curriculum: always ``final``.
    """
    if start <= 0 or steps <= 0 or step >= steps:
        return final
    return round(start + (final - start) * step / steps)


def branch_messages(opening: list[Message], goal: str) -> list[Message]:
    """The short context a branch starts from: the opening system message, the task + the goal."""
    return _task_with(opening, BRANCH_HEADER, goal)
