"""Rollout workers on Ray: a request split across N actors, each a ``RolloutWorker`` with its own engine.

``RayRolloutPool`` has the ``RolloutWorker`` interface the trainer uses (``run``, ``load_weights``,
``policy_version``, ``spec``, ``env_cls``, ``renderer``), so a run switches with ``distributed.backend = "ray"``:

- **Sharding without changing the episodes.** A request's tasks are cut into contiguous shards,
  one per worker; a shard carries ``task_offset``, so each episode is seeded, grouped and given
  demonstrations exactly as in the whole request. The same seed gives the same sampled ids as
  one in-process worker (their log-probs can differ in the last bits: an engine's batch is
  different).
- **Weights.** ``load_weights`` puts the state dict in Ray's object store once and every actor
  reads it from there (never a copy per actor over the driver), at a version. Actors run calls in
  order, so a request sent after a ``load_weights`` samples with the new weights, and no request
  mixes two versions. With ``wait=False`` the weights follow whatever the actors are still
  playing (asynchronous training: ``ctxrl.distributed.staleness``).
- **Workers that die.** An actor may die at any moment (a crash, an OOM kill, ``ray.kill``): while
  it plays a shard, while it loads weights, or idle between steps (found at the next call). Every
  call to an actor goes through ``_call``: when the actor is dead, a fresh one takes its place,
  loads the current weights, and the call is made again on it; after ``retries`` deaths in one
  call (the fresh actor's included) the run stops with a message. Every wait has a deadline
  (``timeout_s``). ``stats`` counts restarts and retried shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ctxrl.errors import CtxrlError
from ctxrl.plain import from_json, to_json
from ctxrl.rollout.spec import RolloutRequest, RolloutSpec
from ctxrl.types import Episode


class WorkerFailure(CtxrlError, RuntimeError):
    """A rollout worker failed past its retries, or did not answer in time."""


CLOSE_TIMEOUT_S = 10.0
"""How long ``close`` (and a restart) waits for an actor to shut its worker down before killing it."""


class _Actor:
    """The body of one Ray actor: a ``RolloutWorker`` built from the spec in the actor's process, after importing
    the spec's plugins (``run.plugins``: a custom environment, manager or runner must be registered before the spec
    is read) and the modules the driver's episode runners come from (so it picks the runner an in-process worker
    would)."""

    def __init__(self, spec_json: str, runners: list[str]) -> None:
        import importlib
        import json

        import torch

        from ctxrl.plugins import import_plugins
        from ctxrl.rollout.worker import RolloutWorker

        torch.set_num_threads(1)
        import_plugins(json.loads(spec_json).get("plugins", ""))
        for module in runners:
            importlib.import_module(module)
        self.worker = RolloutWorker.from_spec(from_json(RolloutSpec, spec_json))

    def load_weights(self, state: Mapping[str, Any], version: int, partial: bool) -> int:
        self.worker.load_weights(state, version=version, partial=partial)
        return version

    def run(self, request_json: str) -> list[str]:
        return [to_json(e) for e in self.worker.run(from_json(RolloutRequest, request_json))]

    def pid(self) -> int:
        import os

        return os.getpid()

    def close(self) -> bool:
        """Shut the worker down (its MCP servers, sandbox processes): ``ray.kill`` skips exit hooks, and a stdio
        MCP server runs in a session of its own that the actor's process group does not reach."""
        self.worker.close()
        return True


def shards(n_tasks: int, n_workers: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` task ranges, as even as possible, none empty."""
    n = min(n_tasks, n_workers)
    bounds = [round(i * n_tasks / n) for i in range(n + 1)] if n else [0]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


class RayRolloutPool:
    """``workers`` rollout actors on Ray (see the module docstring)."""

    def __init__(self, spec: RolloutSpec, *, workers: int = 2, address: str | None = None, timeout_s: float = 600.0,
                 retries: int = 2, num_cpus: float = 1.0, num_gpus: float = 0.0) -> None:
        import ray

        from ctxrl.rollout.runners import runner_modules
        from ctxrl.rollout.worker import spec_env_class, spec_renderer

        if workers < 1:
            raise ValueError(f"a rollout pool needs at least one worker, got {workers}")
        if not ray.is_initialized():
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True)
        self.ray = ray
        self.spec = spec
        self.env_cls = spec_env_class(spec)
        self.renderer = spec_renderer(spec)  # (the trainer decodes samples for its logs with it)
        self.timeout_s, self.retries = timeout_s, retries
        self._remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_Actor)
        self._spec_json = to_json(spec)
        self._runners = runner_modules()
        self.actors = [self._new_actor() for _ in range(workers)]
        self._weights: tuple[Any, int, bool] | None = None  # (object ref, version, partial) last sent
        self._full: tuple[Any, int] | None = None  # the last full state: what a fresh actor needs first
        self._version = 0
        self._pending: list = []
        self.stats = {"restarts": 0, "retried_shards": 0}
        for index in range(workers):
            self._call(index, lambda actor: [actor.pid.remote()], "starting")

    # -- the RolloutWorker interface -------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    def load_weights(self, state: Mapping[str, Any], *, version: int, partial: bool = False, wait: bool = True) -> None:
        """Send ``state`` to every worker through the object store, as ``version``.

        ``wait=False``: return at once; each actor takes the weights after what it is playing now.
        """
        cpu = {name: value.detach().to("cpu") for name, value in state.items()}
        ref = self.ray.put(cpu)
        if not partial:
            self._full = (ref, version)
        self._weights = (ref, version, partial)
        self._version = int(version)
        calls = [[a.load_weights.remote(ref, version, partial)] for a in self.actors]
        if wait:  # (an actor found dead is replaced by one that loads these weights first: nothing to replay)
            for index, sent in enumerate(calls):
                self._call(index, lambda actor: [], f"loading weights (version {version})", sent=sent)
        else:  # a dead actor is found, and replaced with these weights, at its next request
            self._pending += [c for sent in calls for c in sent]

    def run(self, request: RolloutRequest, *, on_episode: Callable[[int, int], None] | None = None) -> list[Episode]:
        """Play ``request`` on all workers (one shard each) and return its episodes in (task, k) order."""
        return self.collect(self.submit(request), on_episode=on_episode)

    def submit(self, request: RolloutRequest) -> list[tuple[RolloutRequest, Any, int]]:
        """Start ``request`` (non-blocking); ``collect`` returns its episodes."""
        out = []
        for index, (start, stop) in enumerate(shards(len(request.tasks), len(self.actors))):
            shard = dataclasses.replace(request, tasks=request.tasks[start:stop],
                                        task_offset=request.task_offset + start)
            out.append((shard, self.actors[index].run.remote(to_json(shard)), index))
        return out

    def collect(self, submitted, *, on_episode: Callable[[int, int], None] | None = None) -> list[Episode]:
        episodes: list[Episode] = []
        total = sum(len(shard.tasks) * shard.group_size for shard, _, _ in submitted)
        for shard, ref, index in submitted:
            request = to_json(shard)
            before = self.stats["restarts"]
            done = self._call(index, lambda actor, request=request: [actor.run.remote(request)],
                              f"playing tasks {shard.task_offset}..{shard.task_offset + len(shard.tasks) - 1}",
                              sent=[ref])
            self.stats["retried_shards"] += self.stats["restarts"] > before
            episodes += [from_json(Episode, e) for e in done[-1]]
            if on_episode is not None:
                on_episode(len(episodes), total)
        return episodes

    def close(self) -> None:
        self._closed(self.actors)
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - dead already
                pass
        self.actors = []

    def _closed(self, actors: list) -> None:
        """Ask ``actors`` to shut their workers down and wait a bounded time; a dead or stuck one is killed after."""
        refs = []
        for actor in actors:
            try:
                refs.append(actor.close.remote())
            except Exception:  # noqa: BLE001 - an actor dead already has nothing left to close
                pass
        try:
            if refs:
                self.ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - (as above)
            pass

    # -- failures ----------------------------------------------------------------------------------------
    def _new_actor(self):
        return self._remote.remote(self._spec_json, self._runners)

    def _call(self, index: int, make: Callable[[Any], list], what: str, *, sent: list | None = None) -> list:
        """The results of the calls ``make(actor)`` makes on actor ``index`` (``sent``: already made). When the actor
        is dead, or dies before they finish, a fresh one takes its place (``_restart``) and ``make`` is called on it,
        at most ``retries`` times; then, or when the calls pass ``timeout_s``, a ``WorkerFailure``."""
        from ray.exceptions import GetTimeoutError, RayActorError, WorkerCrashedError

        calls = sent if sent is not None else make(self.actors[index])
        for attempt in range(self.retries + 1):
            try:
                return self.ray.get(calls, timeout=self.timeout_s)
            except (RayActorError, WorkerCrashedError) as exc:  # (ActorDiedError is a RayActorError)
                if attempt == self.retries:
                    raise WorkerFailure(f"rollout worker {index} died {attempt + 1} times {what}: "
                                        f"{type(exc).__name__}: {exc}") from None
                calls = self._restart(index)
                calls += make(self.actors[index])  # (after the weights: an actor runs its calls in order)
            except GetTimeoutError:
                raise WorkerFailure(f"rollout worker {index} did not finish {what} within distributed.timeout_s="
                                    f"{self.timeout_s:g} s") from None
        raise AssertionError("unreachable")

    def _restart(self, index: int) -> list:
        """A fresh actor in place of a dead one; returns its calls that load the current weights (the last full
        state, then a LoRA run's adapters on top), which run before anything sent to it after them."""
        try:
            self.ray.kill(self.actors[index])
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        actor = self._new_actor()
        calls = [actor.pid.remote()]
        if self._full is not None:
            calls.append(actor.load_weights.remote(self._full[0], self._full[1], False))
        if self._weights is not None and self._weights[2]:
            calls.append(actor.load_weights.remote(*self._weights))
        self.actors[index] = actor
        self.stats["restarts"] += 1
        return calls
