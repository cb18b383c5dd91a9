"""Train an existing agent: the episode runner of ``env.name = "harness"``, ``async def rollout(client, task)``.

``client`` is an official ``openai.AsyncOpenAI`` (or, for a function marked ``client = "anthropic"``, an
``anthropic.AsyncAnthropic``) bound to a fresh session of an in-process ``ctxrl.serve.Server`` over the rollout
worker's own engine (no port, no network: an ASGI transport). Everything the harness sends through it is recorded as
one token-faithful episode (``ctxrl.serve.sessions``); what the function returns is the episode's reward: a number,
or a dict ``{"reward": r, "success": bool, "info": {...}}``. Episodes are grouped per task exactly as a built-in
environment's are, so advantages, filters, context splits, checkpoints and resume all apply unchanged. The
environment's half (``[env.harness]``, ``env.data``: which function, which tasks) is ``ctxrl.envs.harness``; its class
names the runner registered here, which the configuration imports (``ctxrl.run.validate.STAGE_PACKAGES``).

During training the server samples at the rollout settings (``rollout.temperature``, ``top_p``,
``top_k``), whatever the harness asks for, with a seed per episode and call, so the behaviour
policy is the one the learner corrects for and a seeded run repeats. A harness that raises, or
runs past ``rollout.episode_timeout_s``, gives an errored episode (kind ``step`` or ``deadline``);
an error inside ctxrl (the engine) stops the run, as it does for built-in environments.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from ctxrl.envs.harness import RUNNER
from ctxrl.errors import ConfigError
from ctxrl.rollout.agent import EnvironmentFailure, notify, record_error, within
from ctxrl.rollout.runners import EpisodeRunner, OnDone, Worker, register_runner
from ctxrl.rollout.spec import RolloutRequest
from ctxrl.seeds import episode_seed
from ctxrl.types import Episode, Task


def training_server(engine, renderer, limits, api_key: str | None = None):
    """A ``Server`` for a trainer's own sessions: the rollout limits, no caps of its own (the trainer bounds them),
    and no sessions but those the trainer opens (a call to any other is a 404)."""
    from ctxrl.serve.server import Server

    server = Server(engine, renderer, model_name="policy", max_total_tokens=limits.max_total_tokens,
                    max_new_tokens=limits.max_new_tokens, stop_ids=limits.stop_ids, max_concurrency=1 << 30,
                    max_sessions=1 << 30, session_timeout_s=float("inf"), aliases=("ctxrl",), api_key=api_key,
                    client_sessions=False, renders_per_client=1 << 30)  # (in process, every episode is one client)
    server.stop_strings = tuple(limits.stop_strings)
    return server


class Remote:
    """The training server for harnesses in other processes: one per process and port, serving until it exits.

    It runs uvicorn in a daemon thread with its own event loop; every engine call of a remote
    session happens there. A trainer opens sessions (``claims``); a harness takes one with
    ``GET /train/next``, plays it through ``/sessions/<id>/v1`` and ends it with
    ``POST /sessions/<id>/finish {"reward": r}``, which resolves the trainer's wait.

    Every route asks for ``api_key`` when one is set (``ctxrl serve --train`` sets it from
    ``--api-key`` or ``CTXRL_API_KEY``; a plain ``ctxrl train`` reads ``CTXRL_API_KEY``). A harness's
    bad request or bad reward is its 400 and never stops the run; only the engine's failure does.
    """

    _servers: dict[int, Remote] = {}
    api_key: str | None = None
    """The key harnesses must send (``Authorization: Bearer <key>``); None: ``CTXRL_API_KEY``, if set."""

    def __init__(self, engine, renderer, limits, port: int, host: str = "127.0.0.1") -> None:
        import os
        import queue
        import threading

        import uvicorn

        from ctxrl.serve.server import bind

        key = type(self).api_key or os.environ.get("CTXRL_API_KEY") or None
        sock = bind(host, port)  # (a port that is no port, or is in use: one line, before anything says it serves)
        self.server = training_server(engine, renderer, limits, api_key=key)
        self.server.claims = queue.Queue()
        self.server.on_finish = self._finished
        self.waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.server.app(), host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, name="ctxrl-train-server",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"the training server did not start on {host}:{port} within 30 s")
            time.sleep(0.01)
        print(f"ctxrl: harnesses take episodes from http://{host}:{port}/train/next", file=sys.stderr)

    @classmethod
    def get(cls, engine, renderer, limits, port: int) -> Remote:
        remote = cls._servers.get(port)
        if remote is None or remote.server.engine is not engine:
            if remote is not None:
                remote.close()
            remote = cls._servers[port] = cls(engine, renderer, limits, port)
        s = remote.server  # (evaluation and training requests differ in their limits)
        s.max_total_tokens, s.max_new_tokens = limits.max_total_tokens, limits.max_new_tokens
        s.stop_strings = tuple(limits.stop_strings)
        return remote

    def _finished(self, session) -> None:
        loop, future = self.waiting.pop(session.id, (None, None))
        if future is not None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)
        type(self)._servers.pop(self.uvicorn.config.port, None)


def _open(server, sid: str, task: Task, group_id: int, k: int, seed: int, limits, engine):
    """A session for episode ``k`` of group ``group_id``: seeded per call, sampling at the rollout settings."""
    session = server.store.get(sid, task=task)
    session.seed = episode_seed(seed, group_id, k)
    session.sampling = (limits.temperature, limits.top_p, limits.top_k)
    session.episode.group_id, session.episode.policy_version = group_id, engine.policy_version
    return session


def _close(server, sid: str, episode: Episode, start: float) -> Episode:
    server.store.pop(sid)
    if episode.turns and episode.turns[-1].finish_reason == "length" and episode.truncation is None:
        episode.truncation = "max_new_tokens"
    episode.info["seconds"] = time.perf_counter() - start
    episode.info["tool_calls"] = sum(t.tool_calls for t in episode.turns)
    return episode


async def _run_remote(env_cls, tasks, engine, renderer, limits, group_size, seed, on_done,
                      first_group: int = 0) -> list[Episode]:
    remote = Remote.get(engine, renderer, limits, env_cls.remote_port)
    server, loop, run_id = remote.server, asyncio.get_running_loop(), uuid.uuid4().hex[:8]

    async def one(task: Task, group_id: int, k: int) -> Episode:
        sid = f"{run_id}-{group_id}-{k}"
        session = _open(server, sid, task, group_id, k, seed, limits, engine)
        episode = session.episode
        future = loop.create_future()
        remote.waiting[sid] = (loop, future)
        server.claims.put(session)
        start = time.perf_counter()
        try:
            await within(future, limits.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            record_error(episode, exc, limits, time.perf_counter() - start)
        finally:
            remote.waiting.pop(sid, None)
        server.raise_internal()
        return _close(server, sid, episode, start)

    runs = [one(task, group_id, k) for group_id, task in enumerate(tasks, start=first_group)
                for k in range(group_size)]
    return list(await asyncio.gather(*(notify(run, on_done) for run in runs)))


def _result(value: Any) -> tuple[float, bool | None, dict]:
    if isinstance(value, bool) or value is None:
        raise TypeError(f"the harness returned {value!r}; return a number (the reward) or "
                        "{'reward': r, 'success': bool, 'info': {...}}")
    if isinstance(value, (int, float)):
        return _finite_reward(value), None, {}
    if isinstance(value, dict) and isinstance(value.get("reward"), (int, float)):
        return _finite_reward(value["reward"]), value.get("success"), dict(value.get("info") or {})
    raise TypeError(f"the harness returned {type(value).__name__}; return a number (the reward) or "
                    "{'reward': r, 'success': bool, 'info': {...}}")


def _finite_reward(value: float) -> float:
    """A harness's reward as a float; NaN, infinite or past ``MAX_ABS_REWARD`` either way (1e308 is infinite in the
    learner's float32) is the harness's failure (an errored episode), never a reward that would poison the step's
    advantages."""
    from ctxrl.types import MAX_ABS_REWARD

    try:
        reward = float(value)
    except OverflowError:
        reward = math.inf
    if not math.isfinite(reward):
        raise ValueError(f"the harness returned the reward {value!r}; a reward must be a finite number")
    if abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"the harness returned the reward {reward:g}, past {MAX_ABS_REWARD:g} either way (the learner "
                         "computes in float32, where 1e308 is infinite); scale the reward down")
    return reward


def _role_results(value: Any, roles: tuple[str, ...]) -> dict[str, tuple[float, bool | None, dict]]:
    """A multi-role harness's result, ``{role: reward}`` or ``{"rewards": {role: r}, "success": {role: bool},
    "info": {...}}``, as ``(reward, success, info)`` a role; a ``TypeError`` / ``ValueError`` naming what is wrong."""
    if not isinstance(value, dict):
        raise TypeError(f"the harness returned {type(value).__name__}; a harness with roles returns a reward a role: "
                        f"{{{', '.join(repr(r) + ': r' for r in roles)}}} or {{'rewards': {{...}}, 'success': "
                        "{...}, 'info': {...}}")
    rewards = value.get("rewards", value) if isinstance(value.get("rewards"), dict) else value
    success = value.get("success") if isinstance(value.get("success"), dict) else {}
    info = dict(value.get("info") or {}) if "rewards" in value else {}
    missing = [r for r in roles if r not in rewards]
    if missing or set(rewards) - set(roles):
        raise ValueError(f"the harness returned rewards for {sorted(rewards)}; its roles are {list(roles)}: one "
                         "reward each, no others")
    out = {}
    for role in roles:
        reward = rewards[role]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"the harness returned {reward!r} as {role}'s reward; a reward is a number")
        out[role] = (_finite_reward(reward), success.get(role), info)
    return out


async def _each(run, on_done: Callable[[Episode], None] | None) -> list[Episode]:
    """Await ``run`` (a match's coroutine: its seats' episodes), then tell ``on_done`` about the match, through its
    first seat, as the multi-role runner does (a request's progress counts matches)."""
    episodes = await run
    if on_done is not None:
        on_done(episodes[0])
    return episodes


async def run_harness(env_cls: type, tasks: list[Task], engine, renderer, limits, *, group_size: int = 1,
                      seed: int = 0, on_done: Callable[[Episode], None] | None = None,
                      first_group: int = 0) -> list[Episode]:
    """``group_size`` harness rollouts per task, concurrently; episode ``k`` of task ``i`` has group
    ``first_group + i``. A harness with roles (``ctxrl.envs.harness.harness_roles``) plays a match a rollout: one
    session, and so one episode, a role, each with ``Episode.role`` set and its own reward."""
    if getattr(env_cls, "remote_port", None):
        return await _run_remote(env_cls, tasks, engine, renderer, limits, group_size, seed, on_done, first_group)
    if getattr(env_cls, "harness_roles", ()):
        return await _run_match_harness(env_cls, tasks, engine, renderer, limits, group_size, seed, on_done,
                                        first_group)
    import httpx
    import openai


    server = training_server(engine, renderer, limits)
    app = server.app()
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    run_id = uuid.uuid4().hex[:8]
    kind = getattr(env_cls, "harness_client", "openai")
    async with httpx.AsyncClient(transport=transport, base_url="http://ctxrl", timeout=None) as http, \
            _anthropic_http(app, kind == "anthropic") as anthropic_http:

        async def one(task: Task, group_id: int, k: int) -> Episode:
            sid = f"{run_id}-{group_id}-{k}"
            episode = _open(server, sid, task, group_id, k, seed, limits, engine).episode
            if anthropic_http is not None:
                import anthropic

                client = anthropic.AsyncAnthropic(base_url=f"http://ctxrl/sessions/{sid}", api_key="ctxrl",
                                                  http_client=anthropic_http, max_retries=0)
            else:
                client = openai.AsyncOpenAI(base_url=f"http://ctxrl/sessions/{sid}/v1", api_key="ctxrl",
                                            http_client=http, max_retries=0)
            start = time.perf_counter()
            try:
                call = env_cls.harness(client, task)
                value = await within(call, limits.timeout_s)
                reward, success, info = _result(value)
            except (TimeoutError, asyncio.TimeoutError) as exc:
                server.raise_internal()
                record_error(episode, exc, limits, time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - the harness's failure: an errored episode
                server.raise_internal()
                record_error(episode, EnvironmentFailure("step", exc), limits, time.perf_counter() - start)
            else:
                server.raise_internal()
                episode.reward = reward
                episode.success = bool(reward > 0) if success is None else bool(success)
                episode.info.update(info)
            return _close(server, sid, episode, start)

        runs = [one(task, group_id, k) for group_id, task in enumerate(tasks, start=first_group)
                for k in range(group_size)]
        return list(await asyncio.gather(*(notify(run, on_done) for run in runs)))


@contextlib.asynccontextmanager
async def _anthropic_http(app, wanted: bool):
    """An HTTP client of the library the ``anthropic`` SDK is built on (2.x: ``httpx2``; before: ``httpx``) over the
    in-process server, for a harness called with an ``AsyncAnthropic`` (``fn.client = "anthropic"``); else None."""
    if not wanted:
        yield None
        return
    import anthropic

    lib = importlib.import_module("httpx2" if int(anthropic.__version__.split(".")[0]) >= 2 else "httpx")
    transport = lib.ASGITransport(app=app, raise_app_exceptions=False)
    async with lib.AsyncClient(transport=transport, base_url="http://ctxrl", timeout=None) as client:
        yield client


async def _run_match_harness(env_cls, tasks, engine, renderer, limits, group_size, seed, on_done,
                             first_group) -> list[Episode]:
    """``run_harness`` for a harness with roles: a client a role, each on a session of its own (the session id
    names the role), seeded per role; the harness's failure errors every seat of its match."""
    import httpx
    import openai

    roles = env_cls.harness_roles
    server = training_server(engine, renderer, limits)
    transport = httpx.ASGITransport(app=server.app(), raise_app_exceptions=False)
    run_id = uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(transport=transport, base_url="http://ctxrl", timeout=None) as http:

        async def match(task: Task, group_id: int, k: int) -> list[Episode]:
            sids = {role: f"{run_id}-{group_id}-{k}-{role}" for role in roles}
            episodes = {}
            for i, role in enumerate(roles):  # (each seat its own seed: k-th match, i-th role)
                session = _open(server, sids[role], task, group_id, k * len(roles) + i, seed, limits, engine)
                session.episode.role = role
                episodes[role] = session.episode
            clients = {role: openai.AsyncOpenAI(base_url=f"http://ctxrl/sessions/{sids[role]}/v1", api_key="ctxrl",
                                                http_client=http, max_retries=0) for role in roles}
            start = time.perf_counter()
            try:
                call = env_cls.harness(clients, task)
                value = await within(call, limits.timeout_s)
                results = _role_results(value, roles)
            except (TimeoutError, asyncio.TimeoutError) as exc:
                server.raise_internal()
                for episode in episodes.values():
                    record_error(episode, exc, limits, time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - the harness's failure: every seat of the match errored
                server.raise_internal()
                for episode in episodes.values():
                    record_error(episode, EnvironmentFailure("step", exc), limits, time.perf_counter() - start)
            else:
                server.raise_internal()
                for role, (reward, success, info) in results.items():
                    episode = episodes[role]
                    episode.reward = reward
                    episode.success = bool(reward > 0) if success is None else bool(success)
                    episode.info.update(info)
            return [_close(server, sids[role], episodes[role], start) for role in roles]

        runs = [match(task, group_id, k) for group_id, task in enumerate(tasks, start=first_group)
                for k in range(group_size)]
        return [e for seats in await asyncio.gather(*(_each(run, on_done) for run in runs)) for e in seats]


@register_runner
class HarnessRunner(EpisodeRunner):
    """The episode runner of a harness environment (``runner = "harness"`` on the class ``configure`` returns):
    ``run_harness``, one episode per task and group member. Trials and annealed demonstrations are not played."""

    name = RUNNER

    async def play(self, worker: Worker, request: RolloutRequest, on_done: OnDone) -> list[Episode]:
        spec = worker.spec
        if request.attempts(spec) > 1 or (request.phase == "train" and spec.max_demos > 0):
            raise ConfigError("a harness environment plays single episodes: meta.num_attempts = 1 and no "
                              "annealed demos (meta.demos.max = 0)")
        roles = getattr(worker.env_cls, "harness_roles", ())
        if roles and spec.judge.enabled:
            raise ConfigError(f"reward.judge grades one agent's episodes; this harness plays the roles "
                              f"{', '.join(roles)}, whose seats a judge does not grade yet: set "
                              "reward.judge.target=\"\"")
        return await run_harness(worker.env_cls, request.tasks, worker.engine, worker.renderer,
                                 request.limits(spec), group_size=request.group_size, seed=request.seed,
                                 on_done=on_done, first_group=request.task_offset)
