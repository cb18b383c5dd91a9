"""The agent loop: one token-faithful episode, and many of them at once.

Per turn: the engine samples an assistant turn from the current ids; those ids go into the
episode with loss mask 1 and their behaviour log-probs; the text is parsed for tool calls in the
policy's format (``ChatRenderer.parse_assistant``) and handed to ``env.step``; the environment's
reply is rendered *alone* and appended with loss mask 0. The loss mask is therefore decided where
tokens are born and never rebuilt from text. Every token is written through the episode's
``Recorder``; what the model sees as the episode grows is its context manager's decision
(``ctxrl.rollout.managers``), and where the chat template rewrites history at a new user message,
the ``Recorder`` starts a new segment (``info["template_restarts"]``).

Limits end an episode and are recorded in ``Episode.truncation``: ``max_turns``,
``max_new_tokens`` (a turn was cut off before its end-of-turn token), ``max_total_tokens``.

Errors are classified by where they come from. An exception raised by the environment (its
constructor, ``reset`` or ``step``) ends that episode with truncation ``error``: the message is
in ``info["error"]`` and ``info["error_kind"]`` says where (``constructor``, ``reset``, ``step``).
So does running past ``RolloutLimits.timeout_s``, the episode's wall-clock deadline
(``error_kind`` ``deadline``), which covers the environment's set-up (``reset`` then runs in a
daemon thread), model time and tool time. The other episodes go on. A tool's failure is never an
errored episode: it is an observation the model reads (``ctxrl.tools.base.execute_tool_calls``). The
one exception is the process behind a tool dying during a call (an MCP server, ``ToolServerLost``):
``error_kind`` ``tool_server``.
Anything else (the engine, the renderer, a context manager: ctxrl's own code) is not the
episode's fault and is not swallowed: it propagates, and the run stops with its traceback.
``run_episodes`` resets every environment before the first generation, so how long each reset
took never changes which episodes share an engine batch.

A seeded episode seeds each turn's sampling (``derive_seed(seed, turn)``), so it samples the
same tokens however the engine happens to batch it with other episodes.

The agent loop plays given tasks; which tasks, with which settings and seeds, is a
``RolloutRequest``'s business, served by ``RolloutWorker`` (``ctxrl.rollout.worker``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Engine
from ctxrl.rollout.generate import sampling_params
from ctxrl.rollout.managers.base import Play
from ctxrl.rollout.recorder import Recorder
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.seeds import episode_seed
from ctxrl.tools.base import ToolServerLost
from ctxrl.tools.threads import in_daemon_thread
from ctxrl.types import MAX_ABS_REWARD, Episode, Message, Task, Turn


async def run_episode(env: Any, task: Task, engine: Engine, renderer: ChatRenderer, limits: RolloutLimits,
                      *, seed: int | None = None, group_id: int = 0, opening: list | None = None,
                      spent_s: float = 0.0) -> Episode:
    """Play one episode of ``env`` on ``task`` with ``engine``; always returns an ``Episode``.

    ``opening``: the messages ``env.reset`` already returned (``run_episodes`` resets every
    environment before any generation, so that reset times never decide the engine's batches);
    ``spent_s`` is the deadline time that reset used.
    """
    episode = Episode(task=task, group_id=group_id, policy_version=engine.policy_version)
    started = time.perf_counter() - spent_s

    async def body() -> None:
        messages = opening if opening is not None else await reset_env(env, task, seed, limits.timeout_s)
        await _play(env, engine, renderer, limits, seed, episode, messages)

    try:
        await within(body(), limits.timeout_s, spent_s)
    except (EnvironmentFailure, TimeoutError, asyncio.TimeoutError) as exc:  # an errored episode is data
        record_error(episode, exc, limits, time.perf_counter() - started)
    finally:
        try:
            env.close()
        except Exception as exc:  # noqa: BLE001 - a failing close must not lose the episode
            episode.info["close_error"] = f"{type(exc).__name__}: {exc}"
    episode.info["seconds"] = time.perf_counter() - started
    return episode


ERROR_KINDS = ("constructor", "reset", "step", "tool_server", "deadline", "judge")
"""Where an errored episode's error came from (``info["error_kind"]``); ``tool_server``: an MCP server died mid-call;
``judge``: every try of the run's judge failed (``ctxrl.judge``, after the episode was played)."""


class EnvironmentFailure(Exception):
    """An exception the environment raised, with where (``constructor``, ``reset``, ``step``, ``tool_server``): an
    errored episode."""

    def __init__(self, where: str, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.where, self.cause = where, cause


def is_deadline(exc: BaseException, limits: RolloutLimits, elapsed: float) -> bool:
    """Whether ``exc`` is the episode deadline firing (not some other timeout)."""
    return isinstance(exc, (TimeoutError, asyncio.TimeoutError)) and 0 < limits.timeout_s <= elapsed


def record_error(episode: Episode, exc: BaseException, limits: RolloutLimits, elapsed: float) -> None:
    """Mark ``episode`` errored by ``exc``: the environment's failure (with where) or the deadline."""
    episode.truncation = "error"
    if is_deadline(exc, limits, elapsed):
        episode.info["error"] = (f"deadline: the episode ran past rollout.episode_timeout_s={limits.timeout_s:g} s "
                                 f"(in turn {len(episode.turns)})")
        episode.info["error_kind"] = "deadline"
    elif isinstance(exc, EnvironmentFailure):
        episode.info["error"] = f"environment {exc.where}: {exc}"
        episode.info["error_kind"] = exc.where
    else:  # a timeout that is not the deadline: the environment's own
        episode.info["error"] = f"{type(exc).__name__}: {exc}"
        episode.info["error_kind"] = "step"


async def reset_env(env: Any, task: Task, seed: int | None, timeout_s: float) -> list:
    """``env.reset(task, seed=seed)``; with a deadline, in a daemon thread so a hung set-up is abandoned
    (``ctxrl.tools.threads``: it never holds up the step or the process). What ``reset`` raises
    comes back as an ``EnvironmentFailure`` (``reset``)."""
    try:
        if timeout_s <= 0:
            return env.reset(task, seed=seed)
        return await asyncio.wait_for(in_daemon_thread(env.reset, task, seed=seed, name="ctxrl-env-reset"),
                                      timeout_s)
    except (TimeoutError, asyncio.TimeoutError, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - the environment's failure, classified
        raise EnvironmentFailure("reset", exc) from exc


def check_tool_names(schemas: list[dict], manager) -> None:
    """A ``ConfigError`` when one of the environment's tool ``schemas`` has the name of one of ``manager``'s own (the
    policy could not tell them apart, and the manager would take every call)."""
    from ctxrl.errors import ConfigError

    names = {schema["function"]["name"] for schema in schemas}
    clash = sorted(names & {schema["function"]["name"] for schema in manager.tool_schemas})
    if clash:
        raise ConfigError(f"the environment offers a tool named {clash[0]!r}, as context.manager={manager.name} does "
                          "(its own tool): the policy could not tell them apart; leave it out (env.mcp_tools for an "
                          "MCP server's) or use another context manager")


def episode_tools(env, manager, renderer) -> list[dict] | None:
    """The tool schemas an episode offers the policy: the environment's (an MCP server's among them), then the
    context manager's; None for none. A name offered twice, or tools without a tool-call format, is ctxrl's
    set-up, not the episode's fault: a ``ConfigError`` / ``TemplateError`` that stops the run and says why."""
    own = [tool.schema() for tool in env.tools]
    check_tool_names(own, manager)
    tools = [*own, *manager.tool_schemas] or None
    if tools and not renderer.has_tool_format:
        raise renderer.tool_format_error()
    return tools


async def _play(env, engine, renderer, limits: RolloutLimits, seed, episode: Episode, opening) -> None:
    manager = limits.context.make()
    tools = episode_tools(env, manager, renderer)
    play = Play(Recorder(episode, renderer, tools), engine, limits, seed, list(opening))
    try:
        await _turns(env, play, manager)
    finally:
        manager.finish(play)  # e.g. a fold branch still open is closed, the parent becomes the live sequence


async def _turns(env, play: Play, manager) -> None:
    recorder, episode, limits, engine = play.recorder, play.episode, play.limits, play.engine
    renderer = recorder.renderer
    recorder.prompt(play.opening)
    if not manager.fits(len(recorder), limits.max_new_tokens):
        episode.truncation = "max_context"  # the task alone leaves no room for a turn in the budget
        return
    for turn in range(limits.max_turns):
        last = turn == limits.max_turns - 1
        room = limits.max_total_tokens - len(recorder)
        if room <= 0:
            episode.truncation = "max_total_tokens"
            return
        params = sampling_params(limits, renderer, min(limits.max_new_tokens, room), play.seed, turn)
        prompt_tokens = len(recorder)
        completion = await engine.generate(recorder.ids, params)
        text = renderer.decode(completion.token_ids[:-1] if completion.closed else completion.token_ids)
        message = renderer.parse_assistant(text)
        recorder.assistant(completion, message, turn)
        record = Turn(index=turn, prompt_tokens=prompt_tokens, sampled_tokens=len(completion.token_ids),
                      finish_reason=completion.finish_reason, text=text, policy_version=completion.policy_version)
        episode.turns.append(record)
        if completion.truncated:
            hit_total = len(recorder) >= limits.max_total_tokens
            episode.truncation = "max_total_tokens" if hit_total else "max_new_tokens"
            return
        handled = await manager.on_assistant(play, message, turn)
        if handled is not None:  # the manager took the turn (a fold branch opened or returned, or a misuse)
            record.tool_calls, record.tool_errors = 1, int(handled)
            if episode.truncation is None and last:
                episode.truncation = "max_turns"
            if episode.truncation is not None:
                return
            continue
        try:
            result = await env.step(message)
        except Exception as exc:  # noqa: BLE001 - the environment's failure, classified
            raise EnvironmentFailure("tool_server" if isinstance(exc, ToolServerLost) else "step", exc) from exc
        _record_step(episode, record, result)
        if result.terminated:
            return
        if result.truncated:
            episode.truncation = "env"
            return
        if last:
            episode.truncation = "max_turns"
            return
        delta = recorder.observation_ids(result.messages)
        if not manager.fits(recorder.length_after(delta), limits.max_new_tokens):
            if not await manager.make_room(play, result.messages, turn):
                return
            continue
        if recorder.length_after(delta) >= limits.max_total_tokens:
            episode.truncation = "max_total_tokens"
            return
        recorder.observe(result.messages, delta, turn)


def _record_step(episode: Episode, record: Turn, result) -> None:
    """What the environment said about a turn: its reward, tool counts, answer, named actions, success. A reward
    that is not a finite number within ``MAX_ABS_REWARD`` either way errors the episode (``step``): the learner's
    float32 would turn it into NaN losses for the whole batch."""
    reward = float(result.reward)
    if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
        raise EnvironmentFailure("step", ValueError(
            f"the environment gave the reward {reward!r}, past {MAX_ABS_REWARD:g} either way or not finite; scale its "
            "rewards (the learner computes in float32)"))
    record.reward = reward
    episode.reward += reward
    record_turn_info(episode, record, result.info)


def record_turn_info(episode: Episode, record: Turn, info: dict) -> None:
    """A step's ``info`` about the turn it answered: tool counts, answer, named actions, success."""
    record.tool_calls = int(info.get("tool_calls", 0))
    record.tool_errors = int(info.get("tool_errors", 0))
    record.malformed_calls = int(info.get("malformed_tool_calls", 0))
    if "answered" in info:
        record.answered = bool(info["answered"])
    for key in ("actions", "failed_actions"):  # an environment's own names for what it did (see ToolAnswerEnv)
        if key in info:
            episode.info.setdefault(key, []).extend(info[key])
    if "success" in info:
        episode.success = bool(info["success"])
    elif "correct" in info:
        episode.success = bool(info["correct"])


async def run_episodes(make_env: Callable[[], Any], tasks: list[Task], engine: Engine, renderer: ChatRenderer,
                       limits: RolloutLimits, *, group_size: int = 1, seed: int = 0,
                       opening: Callable[[int, int, list[Message]], list[Message]] | None = None,
                       on_done: Callable[[Episode], None] | None = None, first_group: int = 0) -> list[Episode]:
    """Play ``group_size`` episodes per task concurrently; episode ``k`` of task ``i`` has group
    ``first_group + i`` and is seeded as that group's (a shard of a larger request plays its episodes
    exactly as the whole request would).

    Every environment is built and reset first, all of them before any generation: the engine's
    first batch then holds every episode whatever each reset took, so seeded runs repeat exactly.
    A constructor or reset that raises (or passes the deadline) gives an errored episode.

    ``opening(i, k, messages)``: what episode ``k`` of task ``i`` opens with, given what its
    environment's ``reset`` returned (annealed demonstrations write solved examples before the
    task); all of it is context (mask 0). None: the reset's messages as they are.
    ``on_done(episode)``: called as each episode finishes (a progress display).
    """
    jobs = episode_jobs(tasks, group_size, seed, first_group)
    prepared = await asyncio.gather(*(prepare_env(make_env, task, s, limits.timeout_s) for task, _, _, s in jobs))
    runs = []
    for (task, group_id, k, seed_of_episode), (env, reset, spent) in zip(jobs, prepared):
        if env is None:
            runs.append(errored_episode(task, group_id, engine, reset, limits, spent))
        else:
            messages = opening(group_id, k, reset) if opening is not None else reset
            runs.append(run_episode(env, task, engine, renderer, limits, seed=seed_of_episode, group_id=group_id,
                                    opening=messages, spent_s=spent))
    return list(await asyncio.gather(*(notify(run, on_done) for run in runs)))


def episode_jobs(tasks: list[Task], group_size: int, seed: int, first_group: int) -> list[tuple[Task, int, int, int]]:
    """``(task, group id, k, episode seed)`` of episode ``k`` of every task, in request order."""
    return [(task, group_id, k, episode_seed(seed, group_id, k))
            for group_id, task in enumerate(tasks, start=first_group) for k in range(group_size)]


async def prepare_env(make_env: Callable[[], Any], task: Task, seed: int | None, timeout_s: float):
    """``(env, opening, seconds)``: an environment built and reset for ``task``; ``(None, error, seconds)`` when its
    constructor or reset failed (or passed the deadline), its environment closed."""
    t0 = time.perf_counter()
    try:
        env = make_env()
    except Exception as exc:  # noqa: BLE001 - an errored episode, not a crashed step
        return None, EnvironmentFailure("constructor", exc), time.perf_counter() - t0
    try:
        return env, await reset_env(env, task, seed, timeout_s), time.perf_counter() - t0
    except (EnvironmentFailure, TimeoutError, asyncio.TimeoutError) as exc:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - the episode is errored already
            pass
        return None, exc, time.perf_counter() - t0


async def within(coro, timeout_s: float, spent_s: float = 0.0):
    """``coro`` awaited within what is left of a ``timeout_s`` deadline after ``spent_s`` (0: no deadline);
    ``asyncio.TimeoutError`` past it."""
    if timeout_s <= 0:
        return await coro
    return await asyncio.wait_for(coro, max(timeout_s - spent_s, 1e-3))


async def notify(run, on_done: Callable[[Episode], None] | None) -> Episode:
    """Await ``run`` (an episode's coroutine), then tell ``on_done`` about the episode."""
    episode = await run
    if on_done is not None:
        on_done(episode)
    return episode


async def errored_episode(task: Task, group_id: int, engine: Engine, exc: BaseException, limits: RolloutLimits,
                          spent: float) -> Episode:
    """The errored episode of an environment whose constructor or reset failed (``prepare_env``'s ``exc``)."""
    episode = Episode(task=task, group_id=group_id, policy_version=engine.policy_version)
    record_error(episode, exc, limits, spent)
    episode.info["seconds"] = spent
    return episode
