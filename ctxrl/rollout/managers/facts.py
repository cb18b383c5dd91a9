"""What a context rewrite keeps of the facts the answer needs: the measure of *what* a summary (a selection, a
window) holds, not only whether the episode succeeded.

Two figures. ``facts_at_answer`` is the episode's: of the answer's facts, the fraction in the context its last turn
was written from; it compares managers (and ``full``) on one footing. ``fact_survival`` is each rewrite's: a
manager that rewrites the context (``summarize``, ``select``, ``window``) calls ``note_survival`` with the
conversation the policy could see before the rewrite (the live messages and the observations that did not fit)
and the one it restarts from. The facts are the words of the task's answer (``answer_facts``: ``731 482`` on
``fact_hunt``, the two firms and the code on ``search_join``): a fact counts as *seen* when it is in the text
before, and as *kept* when it is still in the text after. Facts the episode has not met yet (the last code, before
the last page) count neither way, so a summary written halfway is scored only on what it could have carried. A
window rewrites at every turn once full and a summary only when asked, so rewrite figures compare runs of one
manager, not managers.

It is a string match on whole words, deliberately simple: a number or a name either survives or it does not. It does
not judge paraphrase, and an answer whose words also appear in the task's own prompt (which every restart keeps)
would score as kept trivially; ``answer_facts`` leaves those out. Issue 49: RL must raise this fraction, not only
success, for a claim that RL improved what the policy writes into its context.
"""

from __future__ import annotations

import re

from ctxrl.types import Episode, Message

SURVIVAL = "fact_survival"
"""``episode.info`` key: one ``[kept, seen]`` pair per rewrite of the context."""


def contains(text: str, fact: str) -> bool:
    """Whether ``fact`` is in ``text`` as a whole word (case-insensitive): ``731`` is not in ``7310``."""
    return re.search(rf"(?<!\w){re.escape(fact)}(?!\w)", text, flags=re.IGNORECASE) is not None


def answer_facts(answer: str, prompt: str = "") -> list[str]:
    """The distinct words of ``answer`` (letters or digits), less those the task's ``prompt`` already shows."""
    words = list(dict.fromkeys(re.findall(r"\w+", answer)))
    return [w for w in words if not contains(prompt, w)]


def _text(messages: list[Message]) -> str:
    return "\n".join(m.content for m in messages)


def survival(facts: list[str], before: list[Message], after: list[Message]) -> tuple[int, int]:
    """(facts of ``facts`` still in ``after``, facts in ``before``): a rewrite's ``[kept, seen]``."""
    seen = [f for f in facts if contains(_text(before), f)]
    after_text = _text(after)
    return sum(contains(after_text, f) for f in seen), len(seen)


def note_survival(episode: Episode, opening: list[Message], before: list[Message], after: list[Message]) -> None:
    """Record one rewrite's ``[kept, seen]`` in ``episode.info`` (``SURVIVAL``)."""
    facts = answer_facts(episode.task.answer or "", _text(opening))
    kept, seen = survival(facts, before, after)
    episode.info.setdefault(SURVIVAL, []).append([kept, seen])


def episode_survival(episode: Episode) -> tuple[int, int]:
    """(kept, seen) summed over an episode's rewrites; (0, 0) when it made none or saw no fact before one."""
    pairs = episode.info.get(SURVIVAL) or []
    return sum(k for k, _ in pairs), sum(s for _, s in pairs)


def survival_rate(episodes: list[Episode]) -> tuple[float, int]:
    """(facts kept / facts seen over every rewrite of ``episodes``, rewrites that saw a fact); NaN, 0 without any."""
    pairs = [p for e in episodes for p in (e.info.get(SURVIVAL) or []) if p[1] > 0]
    seen = sum(s for _, s in pairs)
    return (sum(k for k, _ in pairs) / seen if seen else float("nan")), len(pairs)


def facts_at_answer(episode: Episode) -> float | None:
    """Of the answer's facts, the fraction in the context the episode's last turn was written from; None when the
    episode did not end on a turn of the policy's (it was cut short before answering)."""
    messages = episode.messages
    if not messages or messages[-1].role != "assistant":
        return None
    opening = (episode.segments[0].messages if episode.segments else messages)[:2]
    facts = answer_facts(episode.task.answer or "", _text(opening))
    if not facts:
        return None
    seen = _text(messages[:-1])
    return sum(contains(seen, f) for f in facts) / len(facts)


def answered_rate(episodes: list[Episode]) -> tuple[float, int]:
    """(the mean of ``facts_at_answer`` over the episodes that answered, how many did); NaN, 0 without any."""
    values = [v for v in map(facts_at_answer, episodes) if v is not None]
    return (sum(values) / len(values) if values else float("nan")), len(values)
