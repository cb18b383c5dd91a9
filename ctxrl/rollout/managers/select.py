"""``select`` (ECHO-style selective turn memory): the policy picks which earlier turns to keep, verbatim.

When the next observation would leave no room for a turn in ``max_context_tokens``, the
environment's reply is followed by a user message (``SELECT_INSTRUCTION``) listing the earlier
turns of the context by number, one ``N: call`` line each, and the policy replies which to keep,
``<keep>1 3</keep>`` (sampled, loss mask 1: trained by the outcome reward, like ``summarize``'s
summary). A new segment then starts from a fresh rendering of the opening, the kept turns (an
assistant message with the observations that answered it, re-rendered from its text like
``window``'s), and the newest turn with the observation that did not fit; that one is always kept.

Turns are numbered by their turn in the episode (1 is the first), so a turn keeps its number
across selections and a scripted demo can name it from the conversation alone. Numbers that name
no listed turn are ignored. Fallbacks, deterministic and counted in ``info["select_fallbacks"]``:
a reply without a ``<keep>`` list of numbers keeps the newest earlier turns that fit (``window``);
kept turns that do not fit keep the newest of them that do. If the opening and the newest turn
alone do not fit, the episode ends with truncation ``max_context`` without asking; so does an
episode over budget after ``max_summaries`` selections (``eval_max_summaries`` at evaluation: its table
``[context.select]``, ``SelectSettings``, named as ``summarize``'s). A reply
takes at most ``max_tokens`` tokens. Every action turn is generated within the budget;
the selection step may pass it by one observation, the instruction and the reply.

Credit: the reply's tokens get the episode's advantage (broadcast, like every segment's). ECHO
also routes credit to the source turns a kept turn came from; that is not built here.

Warm-start demos: an environment's own ``select(task, messages)`` hook answers the request, if it
has one; otherwise one is derived from its ``summary`` hook (``scripted_selection``): keep the
earlier turns whose observations hold a number or id the scripted summary mentions (``fact_hunt``:
the first page, with the first code; ``kv_chain``: none, the next key is in the newest turn).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ctxrl.prompts import SELECT_INSTRUCTION
from ctxrl.rollout.generate import sample_aside
from ctxrl.rollout.managers.base import ContextManager, ContextPolicy, Play, register_manager
from ctxrl.rollout.managers.facts import note_survival
from ctxrl.rollout.managers.window import group_turns, leaves_room, split_turns
from ctxrl.rollout.messages import text_only
from ctxrl.seeds import SELECT_SALT
from ctxrl.settings import NON_NEGATIVE, POSITIVE, RESUMABLE
from ctxrl.types import Message, Task

PREVIEW_CHARS = 40
"""Characters of a turn's call shown in the instruction's list."""

_KEEP = re.compile(r"<keep>(.*?)</keep>", re.S)


def parse_keep(text: str) -> list[int] | None:
    """The turn numbers of the last ``<keep>...</keep>`` in ``text`` (space- or comma-separated; may be empty).

    None when there is no such tag or it holds anything but numbers.
    """
    found = _KEEP.findall(text)
    if not found:
        return None
    parts = [p for p in re.split(r"[\s,]+", found[-1].strip()) if p]
    if not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def preview(message: Message, parse: Callable[[str], Message] | None = None) -> str:
    """An assistant message as one short line: its calls (``read(P4821)``), or its text.

    ``parse`` (the renderer's ``parse_assistant``) finds the calls of a message re-rendered from its
    text alone (``text_only``: a turn kept by an earlier restart).
    """
    calls = message.tool_calls or (parse(message.content).tool_calls if parse is not None else [])
    if calls:
        line = "; ".join(f"{c.name}({', '.join(str(v) for v in c.arguments.values())})" for c in calls)
    else:
        line = " ".join(message.content.split())
    return line if len(line) <= PREVIEW_CHARS else line[: PREVIEW_CHARS - 3] + "..."


def instruction(numbered: list[tuple[int, list[Message]]], parse: Callable[[str], Message] | None = None) -> str:
    """The request: ``SELECT_INSTRUCTION`` with one ``N: call`` line per earlier turn."""
    return SELECT_INSTRUCTION.format(turns="\n".join(f"{n}: {preview(turn[0], parse)}" for n, turn in numbered))


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def scripted_selection(messages: list[Message], summary: str) -> str:
    """A demo's reply derived from the environment's scripted ``summary`` of ``messages`` (the conversation so far).

    Keeps the earlier turns (every turn but the newest, numbered from 1) whose observations hold
    a word with a digit (a number, an id) that the summary mentions and the opening does not.
    """
    head, turns = split_turns(messages)
    facts = {w for w in _words(summary) if any(c.isdigit() for c in w)} - _words(" ".join(m.content for m in head))
    keep = [n for n, turn in enumerate(turns[:-1], start=1)
            if facts & _words(" ".join(m.content for m in turn[1:]))]
    return f"<keep>{' '.join(map(str, keep))}</keep>"


@dataclass(frozen=True)
class SelectSettings:
    """``[context.select]``."""

    max_summaries: int = field(default=2, metadata=NON_NEGATIVE)
    """Selections an episode may make in training; past them an over-budget episode ends (``max_context``)."""
    eval_max_summaries: int = field(default=2, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Selections allowed at evaluation (test-time scaling: may exceed max_summaries)."""
    max_tokens: int = field(default=64, metadata=POSITIVE)
    """Tokens one reply naming the turns to keep may take."""

    def limit(self, phase: str) -> int:
        """The selections an episode of ``phase`` (``train`` or ``eval``) may make."""
        return self.max_summaries if phase == "train" else self.eval_max_summaries


@register_manager
class Select(ContextManager):
    """Ask the policy which earlier turns to keep and restart from them (see the module docstring)."""

    name = "select"
    uses_budget = True
    rewrites_context = True
    scripted_hook = "select"
    Settings = SelectSettings

    def __init__(self, policy: ContextPolicy) -> None:
        super().__init__(policy)
        self.numbers: list[int] = []
        """The episode turn numbers (from 1) of the turns the live sequence restarted with."""

    @classmethod
    def demo_script(cls, env_cls: type) -> Callable[[Task, list[Message]], str] | None:
        own = super().demo_script(env_cls)
        if own is not None:
            return own
        from ctxrl.envs.hooks import hook

        summary = hook(env_cls, "summary")
        if summary is None:
            return None
        return lambda task, messages: scripted_selection(messages, summary(task, messages))

    @classmethod
    def demo_hooks(cls) -> str:
        return "select(task, messages) hook or a summary(task, messages)"

    async def make_room(self, play: Play, observations: list[Message], turn: int) -> bool:
        episode, policy, recorder = play.episode, self.policy, play.recorder
        done = episode.info.get("selections", 0)
        if done >= self.options.limit(policy.phase):
            episode.truncation = "max_context"
            return False
        turns = self._turns(play, turn)  # (number, messages), oldest first; the newest has no observation yet
        earlier, (newest_number, newest) = turns[:-1], turns[-1]
        newest = [*newest, *observations]

        def candidate(kept: list[tuple[int, list[Message]]]) -> list[Message]:
            return [*play.opening, *(text_only(m) for _, t in kept for m in t), *(text_only(m) for m in newest)]

        def fits(kept: list[tuple[int, list[Message]]]) -> bool:
            return leaves_room(play, policy.max_context_tokens, candidate(kept))

        def newest_that_fit(pool: list[tuple[int, list[Message]]]) -> list[tuple[int, list[Message]]]:
            return next(pool[start:] for start in range(len(pool) + 1) if fits(pool[start:]))

        if not fits([]):
            episode.truncation = "max_context"  # the opening and the newest turn alone leave no room for a turn
            return False
        ask = [*observations, Message(role="user", content=instruction(earlier, recorder.renderer.parse_assistant))]
        aside = await sample_aside(recorder, ask, play.engine, play.limits, max_new_tokens=self.options.max_tokens,
                                   seed=play.seed, counter=SELECT_SALT + done, purpose="select", turn=turn,
                                   closed=recorder.closed)
        if aside is None or (aside.truncated and len(recorder) >= play.limits.max_total_tokens):
            episode.truncation = "max_total_tokens"
            return False
        chosen = parse_keep(aside.text)
        if chosen is None:
            kept, fallback = newest_that_fit(earlier), True
        else:
            kept = [(n, t) for n, t in earlier if n in set(chosen)]
            fallback = not fits(kept)
            if fallback:
                kept = newest_that_fit(kept)
        info = episode.info
        info["selections"] = done + 1
        info["select_tokens"] = info.get("select_tokens", 0) + aside.tokens
        info["turns_kept"] = info.get("turns_kept", 0) + len(kept)
        info["select_fallbacks"] = info.get("select_fallbacks", 0) + int(fallback)
        note_survival(episode, play.opening, [*recorder.messages, *observations], candidate(kept))
        recorder.restart(candidate(kept), ended_by="select")
        self.numbers = [*(n for n, _ in kept), newest_number]
        return True

    def _turns(self, play: Play, turn: int) -> list[tuple[int, list[Message]]]:
        """The live sequence's turns after the opening, each with its episode turn number (the last is ``turn + 1``)."""
        turns = group_turns(play.recorder.messages[len(play.opening):])
        fresh = len(turns) - len(self.numbers)  # turns played since the restart, numbered up to this one
        return list(zip([*self.numbers, *range(turn + 2 - fresh, turn + 2)], turns))
