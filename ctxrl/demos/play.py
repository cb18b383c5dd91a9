"""Demonstrations: an environment's scripted solutions played through the real agent loop.

Demos are played with a ``ScriptedEngine``, so their ids, masks and observations are built exactly like RL
rollouts; the warm start (``ctxrl.train.sft``, ``ctxrl.train.warm_start``) and the tiny model's pre-training
(``ctxrl.train.tiny``) train on them. ``shortcut_fraction`` of the demos use the environment's ``shortcut``
(an answer without the tool) when it has one: the warm start is imperfect on purpose, so RL has something
real to fix. ``redundant_fraction`` of them use its ``redundant`` script (right, with one tool call too
many): a policy that over-calls, which only a reward for fewer calls (OTC) has reason to change.

Demos played under a context manager with a ``scripted_hook`` (``summarize``: ``summary``) show
the model what RL will ask of it: when the next turn would not fit the budget, the agent loop
asks for a summary and the scripted engine answers with the environment's ``summary(task,
messages)``, written from the conversation so far; the demo then goes on from system + task +
summary with the script's next turn. Every segment trains, its summary tokens included (mask 1).
An environment without the hook cannot show summaries: ``build_demos`` under such a manager is an
error; the warm start decides beforehand (``sft.context_demos``: ``on`` makes it a config error,
``auto`` plays full-context demos and says so in a warning).

Under a manager with a ``solution_hook`` (``fold``: ``folded``) every demo that the draw gives to
``solve`` is played from that hook instead: a whole solution whose turns use the manager's own
tools (``branch`` and ``return``), which the manager handles as in RL. Shortcut and redundant
draws keep their scripts. An environment without the hook cannot show them, as above.

A multi-role environment's demos are matches (``ctxrl.rollout.match``): one scripted engine plays every seat,
``solve``'s turns in play order, so each seat's episode is a demo of its role.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.base import pretraining_env
from ctxrl.envs.hooks import hook
from ctxrl.envs.recorded import RecordedEnv
from ctxrl.envs.roles import is_multi_role
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.managers.base import get_manager
from ctxrl.rollout.match import SeatPolicy, play_match
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.tools.mcp_session import McpError
from ctxrl.types import Episode, Task

WORLD_EPISODES = 100
"""Demos drawn from one world before the next, when demos come from other worlds."""
DEMO_MAX_TURNS = 16
"""Turns a demo may take: room for any environment's scripted solution."""


async def build_demos(env_cls, renderer: ChatRenderer, n: int, *, shortcut_fraction: float = 0.0,
                      redundant_fraction: float = 0.0, seed: int = 0, limits: RolloutLimits | None = None,
                      other_worlds: bool = False) -> list[Episode]:
    """Play ``n`` scripted episodes on training tasks; raises if a script does not fit the limits.

    Each demo is the environment's ``shortcut`` with probability ``shortcut_fraction`` (when it
    has one), else its ``redundant`` script with probability ``redundant_fraction``, else ``solve``.

    ``limits``: the demos' rollout limits (default: generous, full context). Under a context
    manager with a ``scripted_hook`` (``summarize``) the environment needs that hook; each of the
    manager's side requests is answered with it. Under one with a ``solution_hook`` (``fold``:
    ``folded``) the environment needs that hook, and it plays the demos drawn for ``solve``.

    ``other_worlds``: for an environment with a ``pretraining_variant`` (``search_qa``), draw the
    demos from a fresh variant every ``WORLD_EPISODES`` episodes (many invented worlds), so they
    teach the skill (search, read, copy) and no world's facts can be memorised.
    """
    if other_worlds and hook(env_cls, "pretraining_variant") is not None:
        episodes: list[Episode] = []
        for start in range(0, n, WORLD_EPISODES):
            world = pretraining_env(env_cls, seed * 100_003 + start // WORLD_EPISODES)
            episodes += await build_demos(world, renderer, min(WORLD_EPISODES, n - start), seed=seed + start,
                                          shortcut_fraction=shortcut_fraction,
                                          redundant_fraction=redundant_fraction, limits=limits)
        return episodes
    limits = limits or RolloutLimits(max_turns=DEMO_MAX_TURNS, max_new_tokens=4096, max_total_tokens=1 << 20)
    manager = get_manager(limits.context.manager)
    if not manager.demo_ready(env_cls):
        raise ValueError(f"environment {getattr(env_cls, 'name', env_cls.__name__)!r} has no {manager.demo_hooks()} "
                         f"hook, so its demos cannot be played under the {limits.context.manager} manager; give it "
                         "one (docs/environments.md) or play the demos with the full context (sft.context_demos=off)")
    solution = manager.demo_solution(env_cls)
    pick = _demo_scripts(env_cls, shortcut_fraction, redundant_fraction, random.Random(seed), solve=solution)
    tasks = env_cls.sample_tasks("train", n, seed)
    played = await asyncio.gather(*(play_script(env_cls, task, pick(task), renderer, limits, seed=seed)
                                     for task in tasks))
    episodes = [e for one in played for e in (one if isinstance(one, list) else [one])]
    for ep in episodes:
        if ep.truncation is not None and ep.info.get("error_kind") == "tool_server":  # (the server's fault: one line)
            raise McpError(f"the warm start's demonstration of task {ep.task.id} lost its tool server: "
                           f"{ep.info.get('error', '')}; fix the server, or warm-start without demonstrations "
                           "(sft.enabled=false)")
        if ep.truncation is not None:
            raise RuntimeError(_ended_early(ep, limits))
    return episodes


async def play_script(env_cls, task: Task, texts: list[str], renderer: ChatRenderer, limits: RolloutLimits, *,
                      seed: int = 0) -> Episode | list[Episode]:
    """Play ``texts`` on ``task`` through the real agent loop under ``limits`` (its context manager's side requests
    answered by the environment's scripted hook, when the manager has one); a multi-role environment's match gives
    one episode per seat. The episode may end early: callers decide what that means."""
    if is_multi_role(env_cls):  # every seat plays its turns of the script, in play order, as the shared policy
        engine = ScriptedEngine(texts, renderer)
        seating = {role: SeatPolicy("shared", engine=engine) for role in env_cls.roles}
        return await play_match(env_cls(), task, seating, renderer, limits, seed=seed)
    manager = get_manager(limits.context.manager)
    script = manager.demo_script(env_cls)
    if script is not None:
        env = RecordedEnv(env_cls())
        engine = ScriptedEngine(texts, renderer,
                                scripts={manager.scripted_hook: lambda: script(task, env.messages)})
    else:
        env, engine = env_cls(), ScriptedEngine(texts, renderer)
    return await run_episode(env, task, engine, renderer, limits, seed=seed)


def demo_mix_problem(env_cls, shortcut_fraction: float, redundant_fraction: float) -> str | None:
    """Why the environment cannot play this mix of shortcut and redundant demos, or None if it can."""
    name = getattr(env_cls, "name", env_cls.__name__)
    if redundant_fraction > 0 and hook(env_cls, "redundant") is None:
        return (f"environment {name!r} has no redundant hook, so no demo can make a tool call too many; "
                "give it one (docs/environments.md) or set sft.redundant_fraction=0")
    low = shortcut_fraction if hook(env_cls, "shortcut") is not None else 0.0
    if low + redundant_fraction > 1.0 + 1e-9:
        return (f"sft.shortcut_fraction={shortcut_fraction:g} plus sft.redundant_fraction={redundant_fraction:g} "
                f"is more than 1 for environment {name!r} (both draw from the same demos); lower one of them")
    return None


def _demo_scripts(env_cls, shortcut_fraction: float, redundant_fraction: float, rng: random.Random,
                  solve: Callable[[Task], list[str]] | None = None) -> Callable[[Task], list[str]]:
    """Which script plays each demo: one draw of ``rng`` per task decides shortcut, redundant or solve.

    ``solve``: what plays the solve draws (a manager's ``solution_hook``); None: the environment's ``solve``.
    """
    problem = demo_mix_problem(env_cls, shortcut_fraction, redundant_fraction)
    if problem:
        raise ValueError(problem)
    shortcut, redundant = hook(env_cls, "shortcut"), hook(env_cls, "redundant")
    low = shortcut_fraction if shortcut is not None else 0.0
    solve = solve or env_cls.solve

    def pick(task: Task) -> list[str]:
        if shortcut is None and not redundant_fraction:
            return solve(task)  # no draw: the demos' tasks and order stay as they always were
        u = rng.random()
        if u < low:
            return shortcut(task)
        return redundant(task) if u < low + redundant_fraction else solve(task)

    return pick


def _ended_early(episode: Episode, limits: RolloutLimits) -> str:
    """Why a demo did not finish, and which setting to change."""
    what = f"demonstration for task {episode.task.id} ended early ({episode.truncation}"
    what += f": {episode.info['error']})" if episode.info.get("error") else ")"
    manager = get_manager(limits.context.manager)
    if not manager.keeps_budget(limits.context.max_context_tokens):
        return f"{what}; check the env's solve() and the rollout limits"
    if episode.truncation == "max_context" and manager.scripted_hook is None:
        return (f"{what}: its live context leaves no room for a turn of rollout.max_new_tokens={limits.max_new_tokens} "
                f"in context.max_context_tokens={limits.context.max_context_tokens}; raise the budget")
    settings, table = manager.options_of(limits.context), f"context.{manager.name}"
    if episode.truncation == "max_context":
        done = episode.info.get("summaries", 0) + episode.info.get("selections", 0)
        limit = getattr(settings, "max_summaries", "its limit")
        return (f"{what} after {done} scripted summaries or selections: the demo needs more than "
                f"{table}.max_summaries={limit}, or task + summary leave no room for a turn "
                f"in context.max_context_tokens={limits.context.max_context_tokens}; raise one of them")
    if episode.truncation in ("max_new_tokens", "max_total_tokens"):
        return (f"{what}: a scripted turn or summary is longer than the room it gets (rollout.max_new_tokens="
                f"{limits.max_new_tokens}, {table}.max_tokens={getattr(settings, 'max_tokens', '-')}, "
                f"rollout.max_total_tokens={limits.max_total_tokens})")
    return f"{what}; check the env's solve() and summary() and the rollout limits"
