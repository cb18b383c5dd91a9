"""``summarize`` (SUPO / ReSum): the policy summarises its history when the next turn would not fit.

At the end of a turn, if the next generation would not fit in ``max_context_tokens``, the
environment's reply is followed by the summary instruction and the policy writes a summary
(sampled, loss mask 1: trained end to end). The episode then continues in a new segment whose
prompt is exactly the opening system message and the task, with the summary appended to the task
(``restart_messages``), rendered as a fresh prompt. Every action turn is generated within the
budget; the summary step itself may pass it by that one observation, the instruction and the
summary. After ``max_summaries`` summaries an episode that still does not fit ends with truncation
``max_context``. Evaluation may allow more summaries than training (test-time scaling: ``eval_max_summaries``).
Its settings are its own table, ``[context.summarize]`` (``SummarizeSettings``).

In scripted demonstrations the environment's ``summary(task, messages)`` hook answers the
request (``scripted_hook``), so the warm start can show summaries before RL asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxrl.prompts import SUMMARY_HEADER, SUMMARY_INSTRUCTION
from ctxrl.rollout.generate import sample_aside
from ctxrl.rollout.managers.base import ContextManager, Play, register_manager
from ctxrl.rollout.managers.facts import note_survival
from ctxrl.rollout.messages import task_with
from ctxrl.seeds import SUMMARY_SALT
from ctxrl.settings import NON_NEGATIVE, POSITIVE, RESUMABLE
from ctxrl.types import Message


@dataclass(frozen=True)
class SummarizeSettings:
    """``[context.summarize]``."""

    max_summaries: int = field(default=2, metadata=NON_NEGATIVE)
    """Summaries an episode may write in training; past them an over-budget episode ends (``max_context``)."""
    eval_max_summaries: int = field(default=2, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Summaries allowed at evaluation (test-time scaling: may exceed max_summaries)."""
    max_tokens: int = field(default=64, metadata=POSITIVE)
    """Tokens one summary may take."""
    instruction: str = SUMMARY_INSTRUCTION
    """The user message that asks for a summary."""

    def limit(self, phase: str) -> int:
        """The summaries (or selections) an episode of ``phase`` (``train`` or ``eval``) may make."""
        return self.max_summaries if phase == "train" else self.eval_max_summaries


def restart_messages(opening: list[Message], summary: str) -> list[Message]:
    """The conversation a new segment starts from: the opening system message, the task + the summary."""
    return task_with(opening, SUMMARY_HEADER, summary)


@register_manager
class Summarize(ContextManager):
    """Ask the policy for a summary and restart from it (see the module docstring)."""

    name = "summarize"
    uses_budget = True
    rewrites_context = True
    scripted_hook = "summary"
    Settings = SummarizeSettings

    async def make_room(self, play: Play, observations: list[Message], turn: int) -> bool:
        episode, settings = play.episode, self.options
        done = episode.info.get("summaries", 0)
        if done >= settings.limit(self.policy.phase):
            episode.truncation = "max_context"
            return False
        ask = [*observations, Message(role="user", content=settings.instruction)]
        aside = await sample_aside(play.recorder, ask, play.engine, play.limits,
                                   max_new_tokens=settings.max_tokens, seed=play.seed,
                                   counter=SUMMARY_SALT + done, purpose="summary", turn=turn)
        if aside is None:
            episode.truncation = "max_total_tokens"
            return False
        episode.info["summaries"] = done + 1
        episode.info["summary_tokens"] = episode.info.get("summary_tokens", 0) + aside.tokens
        if aside.truncated:
            hit_total = len(play.recorder) >= play.limits.max_total_tokens
            episode.truncation = "max_total_tokens" if hit_total else "max_new_tokens"
            return False
        restarted = restart_messages(play.opening, aside.text)
        note_survival(episode, play.opening, [*play.recorder.messages, *observations], restarted)
        play.recorder.restart(restarted, ended_by="summary")
        if not self.fits(len(play.recorder), play.limits.max_new_tokens):
            episode.truncation = "max_context"  # task + summary alone leave no room for a turn
            return False
        return True
