"""The match loop: one multi-role episode, recorded as one token-faithful sequence per seat, and many at once.

A match seats the roles of a multi-role environment (``ctxrl.envs.roles``; docs/multi-agent.md). Each seat
has its own ``Episode`` (``role``: its role; ``info["seat"]``, ``info["match"]``: which seat of which match,
``info["policy"]``: who played it), its own ``Recorder``, its own context manager and its own seed
(``ctxrl.seeds.seat_seed``). The environment names the seat to act (``to_act``); that seat's pending messages,
everything addressed to it since it last acted, are appended to its sequence (rendered alone, mask 0; on its
first turn, with its opening, as its first prompt), and it takes one turn exactly as the agent loop
(``ctxrl.rollout.agent``) takes one: the same limits, truncations, context-manager calls and per-turn seeds.
A table of one seat (``OneSeat``) therefore records what the agent loop records, token for token.

Who plays a role is a ``SeatPolicy``: an engine samples its turns (mask 1, with behaviour log-probs), or a
scripted player writes them from the seat's ``view`` (mask 0: no policy sampled them). A policy that must not
train (a frozen checkpoint, a script) marks its seats' episodes ``info["trains"] = False``.

A step's rewards (``TableStep.rewards``, under ``roles.rewards``: ``ctxrl.algo.roles.seat_rewards``) go to each
seat's episode reward and to its latest turn; ``outcome`` sets each seat's ``success`` at the end. A match cut
short by one seat's limit gives that seat the limit's truncation and the others ``other_seat``; an environment
failure or the deadline errors every seat. ``env.max_turns`` caps each seat's turns: a match that asks a seat
for one more ends with that seat's truncation ``max_turns`` (for one seat, right after its last turn, as in the
agent loop).

One rule differs from the agent loop, where a table has several seats: a turn cut off at
``rollout.max_new_tokens`` is handed to the environment like any other (which judges it, as an invalid move
for instance), instead of ending the match. Ending it would leave every seat unscored, so a seat losing a hand
could escape its loss by rambling. A table of one seat ends there, as the agent loop does.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ctxrl.algo.roles import seat_rewards
from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Completion, Engine
from ctxrl.envs.base import EnvError
from ctxrl.envs.roles import ScriptedPolicy, roles_of, seat_role
from ctxrl.rollout.agent import (
    EnvironmentFailure,
    episode_jobs,
    episode_tools,
    prepare_env,
    record_error,
    record_turn_info,
    reset_env,
    within,
)
from ctxrl.rollout.generate import sampling_params
from ctxrl.rollout.managers.base import ContextManager, Play
from ctxrl.rollout.recorder import Recorder
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.seeds import seat_seed
from ctxrl.types import Episode, Message, TableStep, Task, Turn

OTHER_SEAT = "other_seat"
"""The truncation of the seats of a match that another seat's limit ended."""


@dataclass(frozen=True)
class SeatPolicy:
    """Who plays a role: ``engine`` samples its turns, or ``script`` writes them; ``label`` names it in
    ``info["policy"]`` (``shared``, ``scripted:NAME``, ``frozen:PATH``); ``trains``: whether its turns are trained."""

    label: str
    engine: Engine | None = None
    script: ScriptedPolicy | None = None
    trains: bool = True

    def __post_init__(self) -> None:
        if (self.engine is None) == (self.script is None):
            raise ValueError(f"seat policy {self.label!r} needs exactly one of an engine and a script")


Seating = Mapping[str, SeatPolicy]
"""Role -> the policy that plays it."""


@dataclass
class Seat:
    """One seat during a match."""

    name: str
    policy: SeatPolicy
    play: Play
    manager: ContextManager
    pending: list[Message] = field(default_factory=list)
    turns: int = 0
    started: bool = False

    @property
    def recorder(self) -> Recorder:
        return self.play.recorder

    @property
    def episode(self) -> Episode:
        return self.play.recorder.episode


def seat_episode(task: Task, seat: str, policy: SeatPolicy, *, group_id: int, match: int) -> Episode:
    """The empty episode of one seat of a match."""
    info: dict[str, Any] = {"seat": seat, "match": match, "policy": policy.label}
    if not policy.trains:
        info["trains"] = False
    version = policy.engine.policy_version if policy.engine is not None else 0
    return Episode(task=task, group_id=group_id, policy_version=version, role=seat_role(seat), info=info)


async def play_match(env: Any, task: Task, seating: Seating, renderer: ChatRenderer, limits: RolloutLimits, *,
                     seed: int | None = None, group_id: int = 0, match: int = 0,
                     opening: Mapping[str, list[Message]] | None = None, spent_s: float = 0.0,
                     reward_mode: str = "env") -> list[Episode]:
    """Play one match of ``env`` on ``task``; always returns its seats' episodes, in the seats' order.

    ``opening``: what ``env.reset`` returned already (``run_matches`` resets every table first); ``spent_s``:
    the deadline time that took. ``seating``: who plays each of ``env``'s roles.
    """
    started = time.perf_counter() - spent_s
    seats: dict[str, Seat] = {}

    async def body() -> None:
        openings = opening if opening is not None else await reset_env(env, task, seed, limits.timeout_s)
        seats.update(_seats(env, task, openings, seating, renderer, limits, seed, group_id, match))
        try:
            await _rounds(env, seats, limits, reward_mode)
        finally:
            for seat in seats.values():
                seat.manager.finish(seat.play)

    try:
        await within(body(), limits.timeout_s, spent_s)
    except (EnvironmentFailure, TimeoutError, asyncio.TimeoutError) as exc:  # an errored match is data
        episodes = [s.episode for s in seats.values()] or _role_episodes(env, task, seating, group_id, match)
        for episode in episodes:
            record_error(episode, exc, limits, time.perf_counter() - started)
        return _closed(env, episodes, started)
    return _closed(env, [s.episode for s in seats.values()], started)


def _closed(env: Any, episodes: list[Episode], started: float) -> list[Episode]:
    try:
        env.close()
    except Exception as exc:  # noqa: BLE001 - a failing close must not lose the match
        for episode in episodes:
            episode.info["close_error"] = f"{type(exc).__name__}: {exc}"
    for episode in episodes:
        episode.info["seconds"] = time.perf_counter() - started
    return episodes


def _role_episodes(env: Any, task: Task, seating: Seating, group_id: int, match: int) -> list[Episode]:
    """One episode per role, for a match that failed before its seats were known."""
    return [seat_episode(task, role, seating[role], group_id=group_id, match=match) for role in roles_of(env)]


def _seats(env: Any, task: Task, openings: Any, seating: Seating, renderer: ChatRenderer, limits: RolloutLimits,
           seed: int | None, group_id: int, match: int) -> dict[str, Seat]:
    """Every seat of the match, from the openings ``reset`` returned (an environment's mistake is its failure)."""
    if not isinstance(openings, Mapping) or not openings:
        raise EnvironmentFailure("reset", EnvError(
            f"a multi-role environment's reset must return every seat's opening as a dict seat -> messages, got "
            f"{type(openings).__name__}"))
    seats = {}
    for index, (name, opening) in enumerate(openings.items()):
        role = seat_role(name)
        if role not in seating:
            raise EnvironmentFailure("reset", EnvError(
                f"reset returned seat {name!r}, whose role {role!r} is not one of its roles ({', '.join(seating)})"))
        manager = limits.context.make()
        tools = episode_tools(env, manager, renderer)  # (ctxrl's set-up, not the match's fault, if it fails)
        policy = seating[role]
        episode = seat_episode(task, name, policy, group_id=group_id, match=match)
        engine = policy.engine if policy.engine is not None else _NoEngine()
        play = Play(Recorder(episode, renderer, tools), engine, limits, seat_seed(seed, index), list(opening))
        seats[name] = Seat(name, policy, play, manager)
    return seats


async def _rounds(env: Any, seats: dict[str, Seat], limits: RolloutLimits, reward_mode: str) -> None:
    """Turns until the environment ends the match or a seat reaches a limit."""
    while True:
        seat = _acting(env, seats)
        if seat.turns >= limits.max_turns:  # asked for a turn beyond its cap: the match cannot go on
            seat.episode.truncation = "max_turns"
            return _end(seats)
        if not await _ready(seat, limits):
            return _end(seats)
        turn, recorder, episode = seat.turns, seat.recorder, seat.episode
        last = turn == limits.max_turns - 1
        room = limits.max_total_tokens - len(recorder)
        if room <= 0:
            episode.truncation = "max_total_tokens"
            return _end(seats)
        message, record, completion = await _sample(env, seat, limits, min(limits.max_new_tokens, room), turn)
        seat.turns += 1
        hit_total = len(recorder) >= limits.max_total_tokens
        if completion.truncated and (hit_total or len(seats) == 1):
            episode.truncation = "max_total_tokens" if hit_total else "max_new_tokens"
            return _end(seats)
        handled = await seat.manager.on_assistant(seat.play, message, turn)
        if handled is not None:  # the manager took the turn (a fold branch), the seat acts again
            record.tool_calls, record.tool_errors = 1, int(handled)
            if episode.truncation is None and last:
                episode.truncation = "max_turns"
            if episode.truncation is not None:
                return _end(seats)
            continue
        try:
            result = await env.step(message)
        except Exception as exc:  # noqa: BLE001 - the environment's failure, classified
            raise EnvironmentFailure("step", exc) from exc
        _record_table_step(seats, seat, record, result, reward_mode)
        if result.terminated:
            return None
        if result.truncated:
            for other in seats.values():
                other.episode.truncation = "env"
            return None


def _acting(env: Any, seats: dict[str, Seat]) -> Seat:
    try:
        name = env.to_act()
    except Exception as exc:  # noqa: BLE001 - the environment's failure
        raise EnvironmentFailure("step", exc) from exc
    if name not in seats:
        raise EnvironmentFailure("step", EnvError(f"to_act() named {name!r}, not a seat of this match "
                                                  f"({', '.join(seats)})"))
    return seats[name]


async def _ready(seat: Seat, limits: RolloutLimits) -> bool:
    """Append what the seat has not read yet (its first prompt, or its pending messages); False: the match ends."""
    recorder, manager, episode = seat.recorder, seat.manager, seat.episode
    if not seat.started:
        seat.started = True
        recorder.prompt([*seat.play.opening, *seat.pending])
        seat.pending = []
        if not manager.fits(len(recorder), limits.max_new_tokens):
            episode.truncation = "max_context"  # the opening alone leaves no room for a turn in the budget
            return False
        return True
    messages, seat.pending, turn = seat.pending, [], seat.turns - 1
    delta = recorder.observation_ids(messages)
    if not manager.fits(recorder.length_after(delta), limits.max_new_tokens):
        return await manager.make_room(seat.play, messages, turn)
    if recorder.length_after(delta) >= limits.max_total_tokens:
        episode.truncation = "max_total_tokens"
        return False
    recorder.observe(messages, delta, turn)
    return True


async def _sample(env: Any, seat: Seat, limits: RolloutLimits, max_new_tokens: int,
                  turn: int) -> tuple[Message, Turn, Completion]:
    """One turn of the seat: sampled by its engine (mask 1) or written by its script (mask 0)."""
    recorder = seat.recorder
    renderer = recorder.renderer
    params = sampling_params(limits, renderer, max_new_tokens, seat.play.seed, turn)
    prompt_tokens = len(recorder)
    if seat.policy.script is not None:
        try:
            text = seat.policy.script(env.view(seat.name), random.Random(params.seed))
        except Exception as exc:  # noqa: BLE001 - the environment's scripted player failed
            raise EnvironmentFailure("step", exc) from exc
        ids = renderer.assistant_ids(renderer.rewrite_hermes(text))[:max_new_tokens + 1]
        cut = len(ids) > max_new_tokens
        ids = ids[:max_new_tokens]
        completion = Completion(ids, [0.0] * len(ids), "length" if cut else "stop")
    else:
        completion = await seat.play.engine.generate(recorder.ids, params)
    text = renderer.decode(completion.token_ids[:-1] if completion.closed else completion.token_ids)
    message = renderer.parse_assistant(text)
    (recorder.scripted if seat.policy.script is not None else recorder.assistant)(completion, message, turn)
    record = Turn(index=turn, prompt_tokens=prompt_tokens, sampled_tokens=len(completion.token_ids),
                  finish_reason=completion.finish_reason, text=text, policy_version=completion.policy_version)
    seat.episode.turns.append(record)
    return message, record, completion


def _record_table_step(seats: dict[str, Seat], seat: Seat, record: Turn, result: TableStep, reward_mode: str) -> None:
    """A step's counts for the acting turn, every seat's reward (on its latest turn too), messages and outcome."""
    if not isinstance(result, TableStep):
        raise EnvironmentFailure("step", EnvError(f"a multi-role environment's step must return a TableStep, got "
                                                  f"{type(result).__name__}"))
    record_turn_info(seat.episode, record, result.info)
    unknown = sorted((set(result.messages) | set(result.rewards) | set(result.outcome)) - set(seats))
    if unknown:
        raise EnvironmentFailure("step", EnvError(f"step addressed {unknown}, not seats of this match "
                                                  f"({', '.join(seats)})"))
    for name, reward in seat_rewards(result.rewards, list(seats), reward_mode).items():
        episode = seats[name].episode
        episode.reward += reward
        if episode.turns:
            episode.turns[-1].reward += reward
    for name, messages in result.messages.items():
        seats[name].pending.extend(messages)
    for name, won in result.outcome.items():
        seats[name].episode.success = bool(won)


def _end(seats: dict[str, Seat]) -> None:
    """One seat reached a limit: the others' matches end with it."""
    for seat in seats.values():
        if seat.episode.truncation is None:
            seat.episode.truncation = OTHER_SEAT


class _NoEngine:
    """A scripted seat's engine: nothing may sample from it (a context manager's side request would)."""

    policy_version = 0

    async def generate(self, prompt_ids, params) -> Completion:
        raise RuntimeError(f"a scripted seat cannot answer a {params.purpose} request: its context manager needs a "
                           "policy; play scripted seats with context.manager=full")

    def load_weights(self, state, *, version: int) -> None:
        raise TypeError("a scripted seat has no weights")


async def run_matches(make_env: Callable[[], Any], tasks: list[Task], seating: Seating, renderer: ChatRenderer,
                      limits: RolloutLimits, *, group_size: int = 1, seed: int = 0, first_group: int = 0,
                      on_done: Callable[[Episode], None] | None = None, reward_mode: str = "env",
                      roles: tuple[str, ...] | None = None) -> list[Episode]:
    """Play ``group_size`` matches per task concurrently: match ``k`` of task ``i`` in group ``first_group + i``,
    seeded as the agent loop seeds episode ``k`` (``run_episodes``); returns every match's seats' episodes, match
    after match. Every table is built and reset before any generation. ``on_done`` hears of each match once (its
    first seat's episode). ``roles``: the environment's (default: ``make_env``'s, a class)."""
    jobs = episode_jobs(tasks, group_size, seed, first_group)
    prepared = await asyncio.gather(*(prepare_env(make_env, task, s, limits.timeout_s) for task, _, _, s in jobs))
    roles = roles or roles_of(make_env)

    async def one(job, ready) -> list[Episode]:
        (task, group_id, k, match_seed), (env, reset, spent) = job, ready
        if env is None:
            episodes = [seat_episode(task, role, seating[role], group_id=group_id, match=k) for role in roles]
            for episode in episodes:
                record_error(episode, reset, limits, spent)
                episode.info["seconds"] = spent
        else:
            episodes = await play_match(env, task, seating, renderer, limits, seed=match_seed, group_id=group_id,
                                        match=k, opening=reset, spent_s=spent, reward_mode=reward_mode)
        if on_done is not None:
            on_done(episodes[0])
        return episodes

    matches = await asyncio.gather(*(one(job, ready) for job, ready in zip(jobs, prepared)))
    return [episode for match in matches for episode in match]
