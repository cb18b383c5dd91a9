"""Episode runners: what plays a ``RolloutRequest``'s episodes for a ``RolloutWorker``.

A runner is a registered ``EpisodeRunner`` class. A worker builds one once, from its spec, its
environment class and its renderer (``make_runner``: what every request needs is prepared then), and
hands it each request: ``play(worker, request, on_done)`` returns episode ``k`` of ``request.tasks[i]``
for every ``(i, k)``, in that order, with group id ``request.task_offset + i``, and calls ``on_done`` as
each one finishes. It reads the worker's engine at every request (a caller may replace it in between).
Three exist:

- ``plain`` (here): the agent loop, one episode per ``(i, k)`` (``run_episodes``);
- ``roles`` (here): a multi-role environment's matches (``ctxrl.rollout.match``), one episode per seat of
  each ``(i, k)``, match after match; its roles played as ``roles.policies`` and the request's ``policies`` say;
- ``meta`` (``ctxrl/meta/runner.py``): trials of several attempts and annealed demonstrations; a request
  that uses neither plays as ``plain`` does;
- ``harness`` (``ctxrl/serve/harness.py``): a user's agent, through an OpenAI client (the environment
  ``ctxrl/envs/harness.py`` names it).

Which one is chosen from the spec and the environment alone (``runner_name``): an environment class
that names a ``runner`` (the harness environment) is played by it; one that declares ``roles`` by ``roles``;
a spec with trials in either phase
or annealed demonstrations by ``meta``; any other by ``plain``. The runners of the layers above rollout
register themselves when their package is imported (rollout never imports them; the configuration does,
before it checks a config: ``ctxrl.run.validate.STAGE_PACKAGES``). A worker in another
process imports ``runner_modules()`` before it reads its spec, so it has the same runners, picks the
same one and plays exactly the episodes an in-process worker would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol, TypeVar

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Engine
from ctxrl.envs.roles import is_multi_role, opponents_of, roles_of
from ctxrl.errors import ConfigError
from ctxrl.registry import Registry
from ctxrl.rollout.agent import run_episodes
from ctxrl.rollout.match import SeatPolicy, run_matches
from ctxrl.rollout.spec import RolloutRequest, RolloutSpec, attempts_of, parse_policy, spec_engine
from ctxrl.types import Episode, Message

PLAIN = "plain"
ROLES = "roles"
META = "meta"
"""The runner of trials and annealed demonstrations: defined in ``ctxrl.meta``, chosen here by name."""

OnDone = Callable[[Episode], None]
Opening = Callable[[int, int, list[Message]], list[Message]]


class Worker(Protocol):
    """What a runner reads from the worker it plays for (a ``RolloutWorker``)."""

    spec: RolloutSpec
    env_cls: type
    engine: Engine
    renderer: ChatRenderer
    role_engines: dict[str, Engine]


class EpisodeRunner:
    """Base of the registered runners (see the module docstring)."""

    name: ClassVar[str] = ""

    def __init__(self, spec: RolloutSpec, env_cls: type, renderer: ChatRenderer) -> None:
        """Prepare what every request of a worker with this spec will need (nothing, unless a runner says)."""

    async def play(self, worker: Worker, request: RolloutRequest, on_done: OnDone) -> list[Episode]:
        raise NotImplementedError


R = TypeVar("R", bound="type[EpisodeRunner]")
RUNNERS: Registry[type[EpisodeRunner]] = Registry("episode runner", (), entry_point_group="ctxrl.runners",
                                                   error=ConfigError)


def register_runner(cls: R) -> R:
    """Class decorator: make ``cls.name`` a runner ``runner_name`` can choose."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} needs a class attribute name to register as an episode runner")
    return RUNNERS.register(cls.name, cls)


async def play_episodes(worker: Worker, request: RolloutRequest, on_done: OnDone, *,
                        opening: Opening | None = None) -> list[Episode]:
    """The agent loop's episodes of ``request`` (``run_episodes``); ``opening`` as there."""
    return await run_episodes(worker.env_cls, request.tasks, worker.engine, worker.renderer,
                              request.limits(worker.spec), group_size=request.group_size, seed=request.seed,
                              opening=opening, on_done=on_done, first_group=request.task_offset)


@register_runner
class PlainRunner(EpisodeRunner):
    """One episode of the agent loop per task and group member."""

    name = PLAIN

    async def play(self, worker: Worker, request: RolloutRequest, on_done: OnDone) -> list[Episode]:
        return await play_episodes(worker, request, on_done)


@register_runner
class MatchRunner(EpisodeRunner):
    """A multi-role environment's matches: every role played as the spec and the request say.

    Frozen checkpoints are loaded once each, into engines of their own that nothing ever sends weights to.
    """

    name = ROLES

    def __init__(self, spec: RolloutSpec, env_cls: type, renderer: ChatRenderer) -> None:
        self.spec, self.env_cls, self.renderer = spec, env_cls, renderer
        self.scripts = opponents_of(env_cls)
        self.frozen: dict[str, Engine] = {}

    async def play(self, worker: Worker, request: RolloutRequest, on_done: OnDone) -> list[Episode]:
        return await run_matches(worker.env_cls, request.tasks,
                                 self.seating(worker.engine, request.policies, worker.role_engines),
                                 worker.renderer, request.limits(worker.spec), group_size=request.group_size,
                                 seed=request.seed, first_group=request.task_offset, on_done=on_done,
                                 reward_mode=worker.spec.roles.rewards, roles=roles_of(self.env_cls))

    def seating(self, engine: Engine, overrides: dict[str, str] | None = None,
                role_engines: dict[str, Engine] | None = None) -> dict[str, SeatPolicy]:
        """Who plays each role: the spec's ``roles.policies`` under ``overrides``; ``engine`` is the shared policy's,
        ``role_engines`` those of the roles with policies of their own (``own``)."""
        seating = {}
        for role in roles_of(self.env_cls):
            label = self.spec.roles.policy(role, overrides)
            try:
                kind, argument = parse_policy(label)
            except ValueError as exc:
                raise ConfigError(f"role {role}: {exc}") from None
            if kind == "scripted":
                if argument not in self.scripts:
                    raise ConfigError(f"role {role}: {self.env_cls.name} has no scripted player {argument!r}; its "
                                      f"opponents(): {', '.join(self.scripts) or 'none'}")
                seating[role] = SeatPolicy(label, script=self.scripts[argument], trains=False)
            elif kind == "frozen":
                seating[role] = SeatPolicy(label, engine=self.frozen_engine(argument), trains=False)
            elif kind == "own":
                if role not in (role_engines or {}):
                    raise ConfigError(f"role {role} plays a policy of its own, but this worker has no engine for it: "
                                      "only a trainer's in-process worker plays roles=own (docs/multi-agent.md)")
                seating[role] = SeatPolicy(label, engine=role_engines[role])
            else:
                seating[role] = SeatPolicy(label, engine=engine)
        return seating

    def frozen_engine(self, path: str) -> Engine:
        """An engine over the checkpoint at ``path`` (loaded the first time), which must share the policy's
        tokenizer: its ids are the policy's ids."""
        if path not in self.frozen:
            from ctxrl.models.loader import load_model, load_tokenizer

            try:
                vocab = load_tokenizer(path).get_vocab()
                model = load_model(path, dtype=self.spec.model.dtype, device=self.spec.model.device)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"frozen:{path}: cannot load a checkpoint there ({exc}); name a checkpoint "
                                  "directory of this model (RUN/checkpoints/step-N or final)") from None
            if vocab != self.renderer.tokenizer.get_vocab():
                raise ConfigError(f"frozen:{path} has another tokenizer than {self.spec.model.name!r}; a frozen "
                                  "opponent must be a checkpoint of the run's model")
            self.frozen[path] = spec_engine(self.spec, model.eval(), self.renderer)
        return self.frozen[path]


def runner_name(spec: RolloutSpec, env_cls: type) -> str:
    """The runner that plays ``spec``'s requests in ``env_cls`` (see the module docstring)."""
    own = getattr(env_cls, "runner", None)
    if own:
        return own
    if is_multi_role(env_cls):
        return ROLES
    trials = max(attempts_of(spec.meta, "train"), attempts_of(spec.meta, "eval")) > 1
    return META if trials or spec.max_demos > 0 else PLAIN


def make_runner(spec: RolloutSpec, env_cls: type, renderer: ChatRenderer) -> EpisodeRunner:
    """The chosen runner, built for a worker with this spec, environment class and renderer."""
    name = runner_name(spec, env_cls)
    if name == META and name not in RUNNERS:
        raise ConfigError("this spec plays trials (num_attempts > 1) or annealed demonstrations (demos.max_demos > 0):"
                          " import ctxrl.meta first, which registers the runner that plays them")
    return RUNNERS.get(name)(spec, env_cls, renderer)


def runner_modules() -> list[str]:
    """The modules the registered runners come from: what a worker in another process imports before it reads
    its spec (``ProcessWorker``, ``RayRolloutPool``), so that it chooses among the same runners as this process."""
    return sorted({RUNNERS.get(name).__module__ for name in RUNNERS.names()})
