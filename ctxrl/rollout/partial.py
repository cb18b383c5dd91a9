"""Partial rollouts: episodes that outlive an RL step and go on with the next step's weights.

With ``rollout.partial_step_tokens = B`` a step does not wait for its slowest episodes. Each episode may sample
``B`` tokens in a step (its turns and their side generations); once it has, its next turn waits at the pool's gate.
The step's collection ends when every episode has finished or waits there. The groups whose every member has
finished are the step's to train; the others are carried over, and after the update and the engine's new weights
their waiting episodes take their next turns on those weights. This is Kimi k1.5's partial rollouts (Kimi Team
2025, "Kimi k1.5: Scaling Reinforcement Learning with LLMs", section 2.6.2: a token budget per trajectory and
iteration, the unfinished rest continued in the next iteration), in one process.

What each token keeps. A cut falls only before an action turn, never inside one, nor between a turn and the side
generations (summaries) that follow it, so every turn is sampled by one version of the weights: the agent loop
stamps it on the turn (``Turn.policy_version``, from ``Completion.policy_version``) and ``types.turn_versions``
gives each sampled token its turn's. The behaviour log-probs are the sampler's, as always: an episode's early
tokens keep the log-probs of the weights that sampled them, which is what the off-policy corrections between the
learner's recomputed log-probs and the behaviour ones (``algo.old_logprobs = "recompute"``, ``algo.offpolicy``)
correct. ``Episode.policy_version`` stays the version the episode started with. Played with a budget it never
reaches, an episode is the very episode a waiting step plays (the same seeds, ids and log-probs).

Groups. A group trains when all its members have finished (its statistics need them all), as a whole, in the step
it finishes. A step starts new groups only up to ``tasks_per_step`` in flight: the carried groups take the places
of as many new ones, so the pool never holds more than one step's worth. A step in which no group finished plays
another round of the budget on the same weights (``rounds``), so every step trains at least one group. An episode
keeps the limits (turn cap, context budget) of the step that started it.

How. The pool keeps one event loop for the worker's life instead of ``asyncio.run`` per request: an episode
waiting at the gate is a suspended coroutine of that loop, its environment open, while the loop is not running
(the learner updates, the engine loads new weights, an evaluation plays in a loop of its own). The engine every
episode reads is the worker's at each call, behind the gate (``Allowance``).

What it does not do: keep episodes across processes. A checkpoint holds no episode in flight (a live environment
cannot be saved); ``close`` drops them and logs how many, and a resumed run starts its step with fresh groups.
It plays the agent loop only (the ``plain`` runner): trials, annealed demonstrations, matches of several roles, a
user's harness and a judge are refused (``RolloutWorker.play_partial``; the config's checks say so first,
``ctxrl.run.validate``), as is the episode deadline, which would count the time an episode waits out the update.
Which tasks a step starts and its figures are ``ctxrl.run.partial``'s.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ctxrl.engine.base import Completion, Engine, SamplingParams
from ctxrl.envs.roles import is_multi_role
from ctxrl.errors import ConfigError
from ctxrl.rollout.agent import episode_jobs, errored_episode, prepare_env, run_episode
from ctxrl.rollout.spec import RolloutLimits, RolloutRequest, attempts_of
from ctxrl.types import Episode

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """One episode in the pool: its coroutine's task, its group, its member index and the step that started it."""

    run: asyncio.Task
    group_id: int
    member: int
    step: int


@dataclass(frozen=True)
class PartialStep:
    """What one step of the pool gave."""

    episodes: list[Episode]
    """The members of the groups that finished in this step, group by group (by group id), member by member."""
    started: int
    """Episodes this step started (its new groups' members)."""
    carried_in: int
    """Episodes started in earlier steps and not yet trained when this step began."""
    carried_trained: int
    """Of ``episodes``, those started in an earlier step."""
    in_flight: int
    """Episodes left in the pool at the step's end: carried over to the next step, or dropped by ``close``."""
    groups_in_flight: int
    """Their groups."""
    rounds: int
    """Rounds of the token budget the step played (more than 1 only when a round finished no group)."""


class Allowance:
    """One episode's engine in the pool: the worker's engine behind the pool's gate, with the tokens it has sampled
    in the current round."""

    def __init__(self, pool: PartialRollouts) -> None:
        self.pool = pool
        self.spent = 0
        self.round = pool.round

    @property
    def policy_version(self) -> int:
        return self.pool.engine.policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        if params.purpose == "turn":  # (a side generation belongs to the turn before it: never cut)
            await self.pool.admit(self)
        completion = await self.pool.engine.generate(prompt_ids, params)
        self.spent += len(completion.token_ids)
        return completion

    def load_weights(self, state, *, version: int) -> None:
        raise TypeError("an episode's engine in a partial rollout takes no weights; the worker's engine does")


class PartialRollouts:
    """The episodes of a worker's partial rollouts (see the module docstring): ``play`` a step, ``close`` at the end.

    ``worker``: a ``RolloutWorker`` (its ``engine``, read at every call, ``env_cls``, ``renderer`` and ``spec``).
    """

    def __init__(self, worker) -> None:
        check_partial(worker.spec, worker.env_cls)
        self.worker = worker
        self.loop = asyncio.new_event_loop()
        self.flights: list[Flight] = []
        self.round = 0
        self.step_tokens = 0
        self.waiting = 0
        """Episodes waiting at the gate for the next round (the round's count: ``open_round`` releases them all)."""
        self._next_round = self.loop.create_future()
        self._changed: asyncio.Event | None = None

    @property
    def engine(self) -> Engine:
        return self.worker.engine

    @property
    def groups_in_flight(self) -> int:
        return len({f.group_id for f in self.flights})

    # -- a step ------------------------------------------------------------------------------------------------
    def play(self, request: RolloutRequest, step_tokens: int) -> PartialStep:
        """Start ``request``'s episodes beside the ones in flight, play rounds of ``step_tokens`` sampled tokens per
        episode until a group has finished and every episode has finished or waits; return the finished groups."""
        if step_tokens < 1:
            raise ValueError(f"a partial rollout needs a budget of 1 or more tokens per episode, got {step_tokens}")
        if request.phase != "train":
            raise ValueError("partial rollouts play training requests; an evaluation waits for its episodes")
        self.step_tokens = step_tokens
        return self.loop.run_until_complete(self._play(request, request.limits(self.worker.spec)))

    async def _play(self, request: RolloutRequest, limits: RolloutLimits) -> PartialStep:
        self._changed = asyncio.Event()
        carried_in = len(self.flights)
        await self._start(request, limits)
        rounds, finished = 0, []
        while not finished and self.flights:
            self.open_round()
            rounds += 1
            await self._until_quiet()
            finished = [g for g in dict.fromkeys(f.group_id for f in self.flights)
                        if all(f.run.done() for f in self.flights if f.group_id == g)]
        done = sorted((f for f in self.flights if f.group_id in set(finished)), key=lambda f: (f.group_id, f.member))
        self.flights = [f for f in self.flights if f.group_id not in set(finished)]
        return PartialStep([f.run.result() for f in done], started=len(request.tasks) * request.group_size,
                           carried_in=carried_in, carried_trained=sum(f.step < request.step for f in done),
                           in_flight=len(self.flights), groups_in_flight=self.groups_in_flight, rounds=rounds)

    async def _start(self, request: RolloutRequest, limits: RolloutLimits) -> None:
        """The request's episodes, each a task of the loop (environments built and reset first, as the agent loop
        does: a failed reset is an errored episode); group ids offset by ``request.group_offset``."""
        jobs = episode_jobs(request.tasks, request.group_size, request.seed, request.task_offset)
        prepared = await asyncio.gather(*(prepare_env(self.worker.env_cls, task, seed, limits.timeout_s)
                                          for task, _, _, seed in jobs))
        for (task, group, member, seed), (env, opening, spent) in zip(jobs, prepared):
            engine, group_id = Allowance(self), request.group_offset + group
            if env is None:
                play = errored_episode(task, group_id, engine, opening, limits, spent)
            else:
                play = run_episode(env, task, engine, self.worker.renderer, limits, seed=seed, group_id=group_id,
                                   opening=opening, spent_s=spent)
            run = self.loop.create_task(play)
            run.add_done_callback(lambda _: self._changed.set())
            self.flights.append(Flight(run, group_id, member, request.step))

    # -- the gate ----------------------------------------------------------------------------------------------
    def open_round(self) -> None:
        """A fresh budget for every episode; the ones waiting take their next turns."""
        self.round += 1
        self.waiting = 0
        released, self._next_round = self._next_round, self.loop.create_future()
        released.set_result(None)

    async def admit(self, allowance: Allowance) -> None:
        """Return when ``allowance``'s episode may take a turn: now while its round's budget lasts, else once the next
        round opens (the next step, on the weights the engine has then)."""
        if allowance.round != self.round:
            allowance.round, allowance.spent = self.round, 0
        if allowance.spent < self.step_tokens:
            return
        self.waiting += 1
        self._changed.set()
        await asyncio.shield(self._next_round)  # (shielded: closing the pool cancels an episode, not the round)
        allowance.round, allowance.spent = self.round, 0

    async def _until_quiet(self) -> None:
        """Until every episode has finished or waits at the gate; an episode's exception (ctxrl's own error: an
        environment's is an errored episode) is raised here."""
        while True:
            for f in self.flights:
                if f.run.done() and not f.run.cancelled() and f.run.exception() is not None:
                    f.run.result()
            if sum(not f.run.done() for f in self.flights) == self.waiting:
                return
            self._changed.clear()
            await self._changed.wait()

    # -- the end -----------------------------------------------------------------------------------------------
    def close(self) -> int:
        """Drop the episodes in flight (their environments closed) and the loop; returns how many were dropped, which
        is logged. Safe to call more than once."""
        if self.loop.is_closed():
            return 0
        dropped = len(self.flights)
        for f in self.flights:
            f.run.cancel()
        pending = asyncio.all_tasks(self.loop)  # (the episodes, and an engine's batching task on this loop)
        for task in pending:
            task.cancel()

        async def settled() -> None:  # (each cancelled episode closes its environment on the way out)
            await asyncio.gather(*pending, return_exceptions=True)

        self.loop.run_until_complete(settled())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        self.flights = []
        if dropped:
            log.warning("partial rollouts: %d episodes in flight were dropped (a checkpoint does not keep them)",
                        dropped)
        return dropped


def check_partial(spec, env_cls: type) -> None:
    """A ``ConfigError`` when a worker's training requests are not the agent loop's plain episodes, which the pool
    plays alone (the config's checks, ``ctxrl.run.validate``, refuse each of these first, naming its fix)."""
    runner = getattr(env_cls, "runner", None)
    refused = [what for what, present in (
        ("several roles", is_multi_role(env_cls)), (f"an environment's own runner ({runner})", bool(runner)),
        ("trials (meta.num_attempts > 1)", attempts_of(spec.meta, "train") > 1),
        ("annealed demonstrations (meta.demos.max > 0)", spec.max_demos > 0),
        ("a judge (reward.judge)", spec.judge.enabled),
        ("an episode deadline (rollout.episode_timeout_s > 0)", spec.train.timeout_s > 0)) if present]
    if refused:
        raise ConfigError("partial rollouts (rollout.partial_step_tokens) play the agent loop's episodes without "
                          f"{', '.join(refused)}: set rollout.partial_step_tokens=0 or leave those out")
