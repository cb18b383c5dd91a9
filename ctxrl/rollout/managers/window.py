"""``window``: drop the oldest whole turns when the next generation would not fit the budget.

When the next observation would leave no room for a turn in ``max_context_tokens``, a new
segment starts from the opening messages and the most recent whole turns (an assistant message
with the observations that answered it) that fit, rendered as a fresh prompt. Nothing is sampled
to make it: it is the baseline ``summarize`` must beat. The newest turn is always kept (it holds
the observation the model has not seen); if even the opening and that turn do not fit, the
episode ends with truncation ``max_context``.
"""

from __future__ import annotations

from ctxrl.rollout.managers.base import ContextManager, Play, register_manager
from ctxrl.rollout.managers.facts import note_survival
from ctxrl.rollout.messages import text_only
from ctxrl.types import Message


def group_turns(messages: list[Message]) -> list[list[Message]]:
    """Messages after an opening as turns: each an assistant message and the replies after it."""
    turns: list[list[Message]] = []
    for m in messages:
        if m.role == "assistant" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns


def split_turns(messages: list[Message]) -> tuple[list[Message], list[list[Message]]]:
    """(the opening: up to the first user message, the turns after it: each an assistant message + replies)."""
    first_user = next((i for i, m in enumerate(messages) if m.role == "user"), None)
    if first_user is None:
        raise ValueError("a conversation to window needs a user message (the task)")
    return messages[: first_user + 1], group_turns(messages[first_user + 1:])


def leaves_room(play: Play, budget: int, messages: list[Message]) -> bool:
    """Whether a prompt of ``messages`` leaves room for the next turn (``max_new_tokens``) within ``budget``."""
    prompt = play.recorder.renderer.prompt_ids(messages, play.recorder.tools)
    return len(prompt) + play.limits.max_new_tokens <= budget


def window_messages(messages: list[Message], fits) -> list[Message] | None:
    """The opening plus the longest suffix of whole turns, at least one turn shorter, for which ``fits`` holds.

    Kept assistant messages are re-rendered from their text alone (``text_only``).
    ``fits(candidate)`` says whether a prompt of these messages leaves room for the next turn.
    None when the opening and the newest turn alone do not fit.
    """
    head, turns = split_turns(messages)
    turns = [[text_only(m) for m in t] for t in turns]
    for start in range(1, len(turns)):
        candidate = head + [m for turn in turns[start:] for m in turn]
        if not candidate[-1].role == "assistant" and fits(candidate):
            return candidate
    return None


@register_manager
class Window(ContextManager):
    """Keep the newest whole turns that fit the budget (see the module docstring)."""

    name = "window"
    uses_budget = True
    rewrites_context = True

    async def make_room(self, play: Play, observations: list[Message], turn: int) -> bool:
        recorder = play.recorder
        before = [*recorder.messages, *observations]
        kept = window_messages(before,
                               lambda messages: leaves_room(play, self.policy.max_context_tokens, messages))
        if kept is None:
            play.episode.truncation = "max_context"
            return False
        note_survival(play.episode, play.opening, before, kept)
        recorder.restart(kept, ended_by="window")
        play.episode.info["windows"] = play.episode.info.get("windows", 0) + 1
        return True
