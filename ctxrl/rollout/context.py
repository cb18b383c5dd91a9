"""Context managers: what the model sees before each generation when an episode outgrows its budget.

- ``full`` (default): the whole history, always (the baseline; ``max_total_tokens`` still caps it).
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

from dataclasses import dataclass

from ctxrl.types import Message

MANAGERS = ("full", "summarize")
SUMMARY_INSTRUCTION = ("Your context is nearly full. Write a short summary of what you have found and what is "
                       "left to do; you will continue from it.")
SUMMARY_HEADER = "\n\nYour summary of the work so far:\n"


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

    def __post_init__(self) -> None:
        if self.manager not in MANAGERS:
            raise ValueError(f"context manager must be one of {', '.join(MANAGERS)}, not {self.manager!r}")
        if self.manager == "summarize" and self.max_context_tokens <= 0:
            raise ValueError("the summarize context manager needs max_context_tokens > 0")

    def over_budget(self, context_tokens: int, next_turn_tokens: int) -> bool:
        """Whether a context of ``context_tokens`` leaves no room for a turn of ``next_turn_tokens``."""
        return self.manager == "summarize" and context_tokens + next_turn_tokens > self.max_context_tokens


def restart_messages(opening: list[Message], summary: str) -> list[Message]:
    """The conversation a new segment starts from: the opening system message, the task + the summary."""
    system = [m for m in opening if m.role == "system"]
    task = next((m for m in opening if m.role == "user"), None)
    if task is None:
        raise ValueError("the episode's opening messages have no user message (the task) to restart from")
    return [*system[:1], Message(role="user", content=task.content + SUMMARY_HEADER + summary.strip())]
