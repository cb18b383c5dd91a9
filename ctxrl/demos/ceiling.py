"""What a context manager allows at best: the environment's scripted solution played under the manager at a budget.

A comparison of context managers means something only if the baseline *could* have won. ``window`` cannot answer a
``fact_hunt`` trail longer than its budget holds, whatever it learns: the first page's code is gone when it answers.
``scripted_ceiling`` measures that before any model trains: each task's scripted solution (``solve``, or the
manager's ``solution_hook``) is played through the real agent loop under the manager, its side requests answered by
the environment's scripted hooks (perfect summaries, the right turns kept), and the task counts as *reachable* when
the context the answer is written from still holds every fact of the answer (``ctxrl.rollout.managers.facts``) and
the episode was not cut short (a task whose answer holds no facts counts when its scripted play succeeds).
A ceiling of 0.00 is a baseline that fails by construction; the plan checker
(``experiments/plan_check.py``) refuses to compare against one. The same play gives the peak working context, the
figure a peak-matched ``window`` takes as its budget.

It is an upper bound for the manager's mechanics, not a prediction: a policy may write worse summaries than the
script, and a ``window`` policy may guess. It needs the environment's ``solve`` and, for a manager with side
requests, its scripted hook.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from ctxrl.chat.render import ChatRenderer
from ctxrl.demos.play import DEMO_MAX_TURNS, play_script
from ctxrl.rollout.managers import get_manager
from ctxrl.rollout.managers.facts import facts_at_answer
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.types import Episode


def reachable(episode: Episode) -> bool:
    """Whether ``episode`` finished and the context its last turn was written from holds every fact of the answer;
    for a task whose answer holds no facts of the episode (``hidden_word``'s guesses, a trial of attempts), whether
    the scripted play succeeded."""
    if episode.truncation is not None:
        return False
    facts = facts_at_answer(episode)
    return bool(episode.success) if facts is None else facts == 1.0


def scripted_ceiling(env_cls, renderer: ChatRenderer, limits: RolloutLimits, n_tasks: int, *, split: str = "heldout",
                     seed: int = 0) -> dict[str, Any]:
    """The manager's ceiling on ``n_tasks`` tasks of ``split`` (the module docstring): the fraction reachable, the
    peak working context (mean and max over tasks), and the fraction cut short."""
    limits = dataclasses.replace(limits, max_turns=max(limits.max_turns, DEMO_MAX_TURNS), temperature=1.0,
                                 timeout_s=0.0)
    solution = get_manager(limits.context.manager).demo_solution(env_cls) or env_cls.solve
    tasks = env_cls.sample_tasks(split, n_tasks, seed)

    async def play_all():
        return await asyncio.gather(*(play_script(env_cls, t, solution(t), renderer, limits, seed=seed) for t in tasks))

    episodes = [e for one in asyncio.run(play_all()) for e in (one if isinstance(one, list) else [one])]
    peaks = [max(len(s.input_ids) for s in e.sequences()) for e in episodes]
    n = max(len(episodes), 1)
    return {"ceiling": sum(map(reachable, episodes)) / n, "tasks": len(episodes),
            "peak_context_mean": sum(peaks) / n, "peak_context_max": max(peaks, default=0),
            "cut_short": sum(e.truncation is not None for e in episodes) / n}
