"""``fold`` (Context-Folding): ``branch(goal)`` / ``return(result)`` tools; a branch's tokens stay out of the parent.

Two more tools are offered to the policy. ``branch(goal)`` pauses the episode's sequence and
starts a branch as its own segment from a short context (the opening system message and the
task, with the goal appended). ``return(result)`` (or a plain reply without a tool call) closes
the branch, and only the result comes back to the parent, as the branch call's tool response;
the parent goes on. One level of branching; ``max_branches`` per episode. A branch segment ends as
``fold`` (it returned a result), ``fold-empty`` (it returned nothing) or ``fold-unfinished`` (the
episode ended first). Misuse (a branch inside a branch, ``return`` outside one, another call in
the same turn, no branches or turns left) is answered with an error observation.

``branch_reward`` (FoldGRPO-style process reward, ``segment_bonus``) is added to the advantage
of every sampled token of a branch that returned a non-empty result. It rewards finishing a
branch, not being right, so keep it small next to the outcome advantage. Both are its own table,
``[context.fold]`` (``FoldSettings``).

The budget is optional (``budget_optional``). With ``max_context_tokens`` > 0 the *live* sequence
(the parent's, or the open branch's) keeps room for a turn within it, so ``fold`` compares with
``window`` / ``summarize`` / ``select`` at an equal working context: an observation, a branch's
result or a branch's opening that would leave no room ends the episode with truncation
``max_context`` (nothing is rewritten to make room: folding is the policy's choice, made
beforehand). With 0 there is no budget, only ``rollout.max_total_tokens``.

Warm-start demos play the environment's ``folded(task)`` hook (``solution_hook``) instead of
``solve``: a whole solution whose turns call ``branch`` and ``return``, played through the agent
loop under this manager, so the policy has branched before RL asks it to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxrl.prompts import BRANCH_HEADER
from ctxrl.rollout.managers.base import ContextManager, ContextPolicy, Play, register_manager
from ctxrl.rollout.messages import task_with
from ctxrl.rollout.recorder import Live
from ctxrl.settings import NON_NEGATIVE
from ctxrl.types import Message, Segment

FOLD_TOOL_SCHEMAS = [
    {"type": "function", "function": {
        "name": "branch", "description": "Work on a sub-task in a fresh context; you get back only its result.",
        "parameters": {"type": "object", "properties": {"goal": {"type": "string"}}, "required": ["goal"]}}},
    {"type": "function", "function": {
        "name": "return", "description": "End the current sub-task and hand its result to the main task.",
        "parameters": {"type": "object", "properties": {"result": {"type": "string"}}, "required": ["result"]}}},
]


def branch_messages(opening: list[Message], goal: str) -> list[Message]:
    """The short context a branch starts from: the opening system message, the task + the goal."""
    return task_with(opening, BRANCH_HEADER, goal)


@dataclass(frozen=True)
class FoldSettings:
    """``[context.fold]``."""

    max_branches: int = field(default=4, metadata=NON_NEGATIVE)
    """Branches an episode may open."""
    branch_reward: float = field(default=0.0, metadata=NON_NEGATIVE)
    """A process reward added to the advantage of every sampled token of a branch that returned a non-empty
    result (FoldGRPO-style; it rewards finishing a branch, not being right, so keep it small; 0 = off)."""


@register_manager
class Fold(ContextManager):
    """At most one open branch, and the parent sequence it paused (see the module docstring)."""

    name = "fold"
    budget_optional = True
    rewrites_context = True
    solution_hook = "folded"
    tool_schemas = FOLD_TOOL_SCHEMAS
    Settings = FoldSettings

    def __init__(self, policy: ContextPolicy) -> None:
        super().__init__(policy)
        self.parent: Live | None = None

    async def on_assistant(self, play: Play, message: Message, turn: int) -> bool | None:
        """Act on a branch / return call; None = not ours (the environment steps).

        On the last turn nothing is appended (no generation would see it) and no branch opens; an
        observation that would pass ``max_total_tokens`` ends the episode there instead.
        """
        last = turn == play.limits.max_turns - 1
        names = [c.name for c in message.tool_calls]
        mine = [c for c in message.tool_calls if c.name in ("branch", "return")]
        if not mine:
            if self.parent is not None and not message.tool_calls and not message.tool_call_errors:
                self._return(play, message.content, turn, last)  # a plain reply ends the branch as its result
                return False
            return None
        e = play.episode
        error = None
        if len(names) > 1 or message.tool_call_errors:
            error = "branch and return must be the only call of their turn"
        elif mine[0].name == "branch" and self.parent is not None:
            error = "a branch cannot open another branch: finish this one with return(result)"
        elif mine[0].name == "return" and self.parent is None:
            error = "return is only for ending a branch; answer the main task directly"
        elif mine[0].name == "branch" and e.info.get("branches", 0) >= self.options.max_branches:
            error = f"no branches left (at most {self.options.max_branches} per episode)"
        elif mine[0].name == "branch" and last:
            error = "no turns left for a branch"
        key = "goal" if mine[0].name == "branch" else "result"
        value = mine[0].arguments.get(key)
        if error is None and not isinstance(value, str):
            error = f"{mine[0].name} needs a string argument {key!r}"
        if error is not None:
            self._observe(play, Message(role="tool", content=f"Error: {error}", name=mine[0].name), turn, last)
            return True
        if mine[0].name == "return":
            self._return(play, value, turn, last)
            return False
        self.parent = play.recorder.open_branch(branch_messages(play.opening, value))
        e.info["branches"] = e.info.get("branches", 0) + 1
        if not self.fits(len(play.recorder), play.limits.max_new_tokens):
            e.truncation = "max_context"  # the branch's task + goal leave no room for a turn
        return False

    def finish(self, play: Play) -> None:
        if self.parent is not None:
            self._close(play, "fold-unfinished")  # the parent is the live sequence at the end

    @classmethod
    def segment_bonus(cls, segment: Segment, policy: ContextPolicy) -> float:
        return cls.options_of(policy).branch_reward if segment.ended_by == "fold" else 0.0

    def _return(self, play: Play, result: str, turn: int, last: bool) -> None:
        self._close(play, "fold" if result.strip() else "fold-empty")
        self._observe(play, Message(role="tool", content=result, name="branch"), turn, last)

    def _observe(self, play: Play, observation: Message, turn: int, last: bool) -> None:
        """Append an observation to the live sequence, unless no generation would ever see it; one that leaves
        no room for a turn in the budget ends the episode (``max_context``), one past ``max_total_tokens`` too."""
        if last:
            return
        recorder = play.recorder
        delta = recorder.observation_ids([observation])
        if not self.fits(recorder.length_after(delta), play.limits.max_new_tokens):
            play.episode.truncation = "max_context"  # as make_room's default: the budget ends the episode
            return
        if recorder.length_after(delta) >= play.limits.max_total_tokens:
            play.episode.truncation = "max_total_tokens"
            return
        recorder.observe([observation], delta, turn)

    def _close(self, play: Play, ended_by: str) -> None:
        length = play.recorder.close_branch(self.parent, ended_by=ended_by)
        play.episode.info["branch_tokens"] = play.episode.info.get("branch_tokens", 0) + length
        self.parent = None
