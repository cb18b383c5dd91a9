"""``openenv:NAME``: an OpenEnv environment played by ctxrl's agent loop, in process.

OpenEnv (``pip install -e '.[openenv]'``: ``openenv-core``) packages an environment as a subclass of its
``Environment`` with ``reset() -> Observation``, ``step(action) -> Observation`` and ``state``; an ``Action`` and an
``Observation`` are dataclasses of the environment's own fields (``Observation`` adds ``done``, ``reward`` and
``metadata``). ``env.name = "openenv:NAME"`` loads one: ``NAME`` is ``package.module:ClassName`` or
``path/to/file.py:ClassName`` (the file's folder is put on ``sys.path``, as OpenEnv's servers import their
``models``); ``[env.openenv] args`` are its constructor's keyword arguments.

**How an episode maps.** The policy gets one tool, named after the action (``EchoAction`` -> ``echo_action``), whose
parameters are the action's fields (the dataclass fields of the class ``step`` is annotated with, ``metadata``
left out; their JSON types from the annotations). ``reset`` is the episode's opening: the system prompt
(``[env.openenv] system_prompt``, or one naming the tool) and the observation's fields as the user message. Each
call of the tool is one ``Environment.step``, run in a worker thread (OpenEnv environments are synchronous); its
observation's fields are the tool's result, its ``reward`` the turn's reward (summed over the turn's calls, ``None``
as 0), and ``done`` ends the episode. A call with arguments the action does not take is an error observation, as
for any ctxrl tool. A turn without a call ends the episode with the rewards it had. The episode succeeds when its
reward reaches ``[env.openenv] success_reward`` (1.0).

**Tasks and splits.** OpenEnv has no datasets: a task is a seed. When the environment's ``reset`` takes a ``seed``
(OpenEnv 0.2 and later declare ``reset(seed=None, episode_id=None)``), train and held-out tasks are disjoint sets
of seeds; when it does not (OpenEnv 0.1's ``reset()``), there is only the ``train`` split and the environment's own
randomness varies the episodes. There is no OOD split and no ``solve``: without a scripted solution, a warm start
cannot be made from it (``sft.steps = 0``), and ``check-env`` reports what it can check.

What is refused, with a message saying why: an ``Environment`` whose ``step`` is not annotated with its action class
(no schema to show the policy); an action field whose type has no JSON type (``bytes``, a class); an observation
that is not a dataclass or a pydantic model. Not here: OpenEnv's HTTP and WebSocket clients. An OpenEnv 0.1 HTTP
server holds one episode at a time, and ctxrl plays many at once; openenv-core 0.2 and later (sessions per
WebSocket) depend on fastmcp 3, which needs mcp < 2, while ctxrl's ``serve`` and ``mcp`` extras need mcp >= 2.3, so
they cannot be installed beside them. ``openenv:http://...`` says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import json
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ctxrl.envs.base import EnvError
from ctxrl.envs.from_verifiers import load_args
from ctxrl.plugins import import_file
from ctxrl.tasks.space import ContextSpace, split_of, task_id
from ctxrl.tools.base import Tool, validate_arguments
from ctxrl.types import Message, StepResult, Task

EXTRA = "pip install -e '.[openenv]'"
SUMMARY = "an OpenEnv environment in process (openenv:package.module:Class or openenv:path/to/file.py:Class)"
TASKS = 4096
"""How many seeds a split draws from (train and held-out: disjoint by a stable hash)."""
HTTP_REFUSED = (
    "openenv:{rest}: OpenEnv's HTTP and WebSocket clients are not mapped. An OpenEnv 0.1 HTTP server holds one "
    "episode at a time (ctxrl plays many at once), and openenv-core 0.2+ (sessions per WebSocket) depends on "
    "fastmcp 3, which needs mcp < 2, while ctxrl's serve and mcp extras need mcp >= 2.3. Load the environment in "
    "process instead: openenv:package.module:EnvironmentClass (or openenv:path/to/file.py:EnvironmentClass).")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Settings:
    """The table ``[env.openenv]`` (``env.openenv.KEY=VALUE`` on the command line)."""

    args: list[str] = field(default_factory=list)
    """Keyword arguments of the environment's constructor, each ``NAME=VALUE`` with a TOML value."""
    system_prompt: str = ""
    """The system message (empty: one that names the action tool)."""
    success_reward: float = 1.0
    """An episode whose reward reaches this succeeded."""
    heldout_fraction: float = 0.2
    """With a seeded ``reset``: the share of seeds held out."""

    def __post_init__(self) -> None:
        load_args(self.args)
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


def _openenv():
    try:
        from openenv_core.env_server import Environment
    except ImportError:
        raise EnvError(f"OpenEnv environments need the openenv-core package: {EXTRA}") from None
    return Environment


def environment(rest: str) -> type:
    """The class ``openenv:REST`` names."""
    rest = rest.strip()
    if rest.startswith(("http://", "https://", "ws://")):
        raise EnvError(HTTP_REFUSED.format(rest=rest))
    if ":" not in rest:
        raise EnvError(f"openenv:{rest} names no environment class; write openenv:package.module:ClassName or "
                       "openenv:path/to/file.py:ClassName")
    return _environment_class(rest)


@functools.cache
def _environment_class(source: str) -> type:
    target = _load(source)
    action = _action_class(target, source)
    tool = re.sub(r"(?<!^)(?=[A-Z])", "_", action.__name__).lower()
    schema = _schema(action, source)
    seeded = "seed" in inspect.signature(target.reset).parameters
    return type(f"OpenEnv[{source}]", (OpenEnvEnv,), {
        "source": source, "name": f"openenv:{source}", "target": target, "action": action, "tool_name": tool,
        "action_schema": schema, "seeded": seeded, "__doc__": (target.__doc__ or "").strip().split("\n")[0]})


def _load(source: str) -> type:
    Environment = _openenv()
    module_name, _, attr = source.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise EnvError(f"openenv:{source}: no such file")
            if str(path.parent.resolve()) not in sys.path:  # (OpenEnv servers import their models by name)
                sys.path.insert(0, str(path.parent.resolve()))
            module = import_file(path, "ctxrl_openenv")
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(f"openenv:{source}: cannot import {module_name!r}: {exc}") from None
    target = getattr(module, attr, None)
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise EnvError(f"openenv:{source}: {attr!r} is not an OpenEnv Environment subclass")
    return target


def _action_class(target: type, source: str) -> type:
    from openenv_core.env_server import Action

    try:
        hints = typing.get_type_hints(target.step)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: said below
        hints = {}
    action = next((h for name, h in hints.items() if name != "return"), None)
    if not (isinstance(action, type) and issubclass(action, Action) and action is not Action):
        raise EnvError(f"openenv:{source}: {target.__name__}.step is not annotated with its Action class "
                       "(def step(self, action: MyAction)), so ctxrl has no schema to show the policy")
    return action


def _json_type(annotation: Any, where: str) -> dict:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return _json_type(args[0], where)
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    base = origin or annotation
    if base in _JSON_TYPES:
        return {"type": _JSON_TYPES[base]}
    raise EnvError(f"{where} has the type {annotation!r}, which has no JSON type to show the policy")


def _schema(action: type, source: str) -> dict:
    hints = typing.get_type_hints(action)
    fields = [f for f in dataclasses.fields(action) if f.name != "metadata"]
    properties = {f.name: _json_type(hints[f.name], f"openenv:{source}: {action.__name__}.{f.name}") for f in fields}
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def render(observation: Any) -> str:
    """An observation's own fields (not ``done``, ``reward``, ``metadata``) as ``name: value`` lines."""
    if dataclasses.is_dataclass(observation):
        values = dataclasses.asdict(observation)
    elif hasattr(observation, "model_dump"):
        values = observation.model_dump()
    else:
        raise EnvError(f"an OpenEnv observation must be a dataclass or a pydantic model, got {type(observation)}")
    lines = [f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in values.items()
             if k not in ("done", "reward", "metadata")]
    return "\n".join(lines) or "(no fields)"


class OpenEnvEnv:
    """An OpenEnv environment played by ctxrl's agent loop (see the module docstring)."""

    Settings: ClassVar[type] = Settings
    options: ClassVar[Settings] = Settings()
    source: ClassVar[str] = ""
    name: ClassVar[str] = "openenv"
    target: ClassVar[type | None] = None
    action: ClassVar[type | None] = None
    tool_name: ClassVar[str] = "act"
    action_schema: ClassVar[dict] = {}
    seeded: ClassVar[bool] = False
    context_space: ClassVar[ContextSpace] = ContextSpace([])

    @classmethod
    def system(cls) -> str:
        return cls.options.system_prompt or (
            f"You act in an environment by calling the tool {cls.tool_name}; each call is one step, and its result is "
            "what you observe. Keep acting until the episode ends.")

    system_prompt: ClassVar[str] = ""

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        return ("train", "heldout") if cls.seeded else ("train",)

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` seeds of ``split`` (module docstring), reproducible from ``seed``."""
        if split not in cls.splits():
            raise EnvError(f"{cls.name} has no {split!r} tasks (it has {', '.join(cls.splits())})")
        import random

        rng = random.Random(f"ctxrl-openenv:{seed}:{split}")
        tasks = []
        while len(tasks) < n:
            env_seed = rng.randrange(TASKS)
            if cls.seeded and split_of(f"seed:{env_seed}", cls.options.heldout_fraction) != split:
                continue
            prompt = f"{cls.name} seed {env_seed}"
            tasks.append(Task(id=task_id("openenv", prompt), prompt=prompt, answer="", split=split,
                              data={"seed": env_seed}))
        return tasks

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        raise EnvError(f"{cls.name}: OpenEnv environments have no scripted solution (no warm start from it; set "
                       "sft.steps = 0)")

    def __init__(self) -> None:
        cls = type(self)
        if cls.target is None:
            raise EnvError("name an OpenEnv environment: env.name = \"openenv:package.module:Class\"")
        self.system_prompt = cls.system()
        self.env = cls.target(**load_args(cls.options.args))
        self.tools = [Tool(cls.tool_name, (cls.action.__doc__ or f"One step: a {cls.action.__name__}.").strip(),
                           cls.action_schema, self._refuse)]
        self._done, self._started, self._total = False, False, 0.0

    @staticmethod
    def _refuse(**_: Any) -> str:
        raise EnvError("the OpenEnv adapter runs its tool in step(); the agent loop never calls it")

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        seed_kwargs = {"seed": task.data.get("seed")} if type(self).seeded else {}
        observation = self.env.reset(**seed_kwargs)
        if getattr(observation, "done", False):
            raise EnvError(f"{type(self).name}: the episode was done at reset")
        self._done, self._started, self._total = False, True, 0.0
        return [Message("system", self.system_prompt), Message("user", render(observation))]

    async def step(self, message: Message) -> StepResult:
        if not self._started:
            raise EnvError("step() called before reset(task); start an episode with reset first")
        if self._done:
            raise EnvError("step() called after the episode terminated; call reset(task) to start a new episode")
        if not message.tool_calls and not message.tool_call_errors:
            self._done = True
            return StepResult(messages=[], reward=0.0, terminated=True, info={"no_action": True, **self._outcome()})
        observations = [Message("tool", f"Error: {e}") for e in message.tool_call_errors]
        reward, errors, calls = 0.0, len(message.tool_call_errors), 0
        for call in message.tool_calls:
            calls += 1
            problem = (f"unknown tool {call.name!r}; the tool is {type(self).tool_name}"
                       if call.name != type(self).tool_name else validate_arguments(type(self).action_schema,
                                                                                      call.arguments))
            if problem is not None:
                observations.append(Message("tool", f"Error: {problem}", name=call.name))
                errors += 1
                continue
            try:
                action = type(self).action(**call.arguments)
                observation = await asyncio.to_thread(self.env.step, action)
            except Exception as exc:  # noqa: BLE001 - the environment refused the action: an observation
                observations.append(Message("tool", f"Error: {type(exc).__name__}: {exc}", name=call.name))
                errors += 1
                continue
            reward += float(getattr(observation, "reward", None) or 0.0)
            observations.append(Message("tool", render(observation), name=call.name))
            if getattr(observation, "done", False):
                self._done = True
                break
        self._total += reward
        info = {"tool_calls": calls + len(message.tool_call_errors), "tool_errors": errors,
                "malformed_tool_calls": len(message.tool_call_errors), **(self._outcome() if self._done else {})}
        return StepResult(messages=observations, reward=reward, terminated=self._done, info=info)

    def _outcome(self) -> dict:
        return {"success": self._total >= type(self).options.success_reward}

    def close(self) -> None:
        self._started = False
        closer = getattr(self.env, "close", None)
        if callable(closer):
            closer()
