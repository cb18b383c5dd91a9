"""``harness``: the environment of an existing agent under training, a user's ``async def rollout(client, task)``.

This file is the environment's half: ``HarnessEnv.configure`` reads ``[env.harness]`` ``agent`` (the agent, as
``package.module:rollout`` or ``path/to/file.py:rollout``, or ``remote:PORT`` for agents in other
processes) and ``env.data`` (where the tasks come from), loads the function, and returns the class
a run uses: the data's environment class (its tasks, splits and demonstrations) with the agent on
it. That class names its episode runner (``runner = RUNNER``), which plays each episode through an
OpenAI client bound to a session of ctxrl's own server: ``ctxrl.serve.harness`` defines it and
registers it when imported, and docs/serve.md describes the rest. Nothing here plays an episode.

Configuration::

    [env]
    name = "harness"
    data = "env:calculator"     # tasks (and warm-start demonstrations) from a registered environment,
                                # or a JSONL task file as for jsonl_tools (then tools and verifier below)

    [env.harness]
    agent = "examples/harness_calculator.py:rollout"   # or package.module:rollout, or remote:PORT

A harness written with the Anthropic SDK says so on its function (``rollout.client = "anthropic"``): it is called with
an ``anthropic.AsyncAnthropic`` bound to its session's Messages route instead of an ``openai.AsyncOpenAI``
(``harness_client``). A harness that plays several roles declares them on its function (``match.roles = ("asker",
"answerer")``): it is called ``match(clients, task)`` with a client per role and returns a reward per role
(``harness_roles``).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ctxrl.envs.registry import configured_env_class, register
from ctxrl.errors import ConfigError
from ctxrl.plugins import import_file
from ctxrl.types import Task

RUNNER = "harness"
"""The episode runner that plays a harness environment's episodes (registered by ``ctxrl.serve.harness``)."""


def load_function(ref: str) -> Callable:
    """``package.module:name`` or ``path/to/file.py:name`` -> the function."""
    module_name, _, attr = ref.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"env.harness.agent must be 'package.module:function' or 'path/to/file.py:function', "
                          f"got {ref!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"env.harness.agent: no file {path}")
            module = import_file(path, "ctxrl_harness")
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"env.harness.agent: cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"env.harness.agent: {module_name!r} has no function {attr!r}")
    if not asyncio.iscoroutinefunction(fn):
        raise ConfigError(f"env.harness.agent: {ref} must be an async function: async def {attr}(client, task)")
    return fn


@dataclass(frozen=True)
class HarnessSettings:
    """``[env.harness]``: the agent under training, and how a JSONL task file's tasks are played."""

    agent: str = ""
    """The agent to train, an ``async def rollout(client, task)`` given as ``package.module:function`` or
    ``path/to/file.py:function`` (or ``remote:PORT``, agents in other processes); its OpenAI client's calls are the
    episode and its return value the reward. ``env.data`` is then ``env:NAME`` (a registered environment's tasks)
    or a JSONL task file (docs/serve.md)."""
    tools: str = ""
    """For a JSONL task file: comma-separated built-in tools, as ``[env.jsonl_tools]``'s."""
    verifier: str = "exact"
    """For a JSONL task file: the answer check, as ``[env.jsonl_tools]``'s."""


@register("harness")
class HarnessEnv:
    """Placeholder registered as ``harness``; ``configure`` returns the class a run uses (see the module docstring)."""

    name = "harness"
    harness: Callable | None = None
    Settings = HarnessSettings

    @classmethod
    def configure(cls, *, data: str = "", agent: str = "", tools: str = "", verifier: str = "exact", **_) -> type:
        harness = agent
        if not harness:
            raise ConfigError("env.name = 'harness' needs env.harness.agent = 'module:function' (an async "
                              "def rollout(client, task) -> reward)")
        if not data:
            raise ConfigError("env.name = 'harness' needs env.data: 'env:NAME' (a registered environment's tasks) "
                              "or a JSONL task file")
        remote = harness.startswith("remote")
        fn = remote_marker if remote else load_function(harness)
        port = _remote_port(harness) if remote else None
        roles = harness_roles(fn, harness)
        client = harness_client(fn, harness)
        if data.startswith("env:"):
            source = configured_env_class(data[4:])
        else:
            source = configured_env_class("jsonl_tools", data=data, tools=tools, verifier=verifier)
        # The source environment's class, with its tasks, splits and demonstrations; episodes come from the harness.
        return type(f"Harness[{getattr(source, 'name', source.__name__)}]", (source,),
                    {"harness": staticmethod(fn), "harness_ref": harness, "remote_port": port, "runner": RUNNER,
                     "harness_roles": roles, "harness_client": client,
                     "Settings": None})  # ([env.harness] is read here; the source keeps its own options)

    @staticmethod
    def sample_tasks(split: str, n: int, seed: int) -> list[Task]:
        raise ConfigError("the harness environment needs env.harness.agent and env.data (docs/serve.md)")


def harness_roles(fn: Callable, ref: str) -> tuple[str, ...]:
    """The roles a harness plays (its function's ``roles`` attribute: ``match.roles = ("proposer", "solver")``), or
    () for one agent. A harness with roles is called ``fn(clients, task)`` with one client a role, each bound to a
    session of its own (one token-faithful sequence a role), and returns a reward a role."""
    roles = getattr(fn, "roles", ())
    if not roles:
        return ()
    if isinstance(roles, str) or not all(isinstance(r, str) and r.isidentifier() for r in roles):
        raise ConfigError(f"env.harness.agent: {ref}'s roles must be a tuple of names (identifiers), such as "
                          f"('proposer', 'solver'); got {roles!r}")
    if len(set(roles)) != len(roles) or len(roles) < 2:
        raise ConfigError(f"env.harness.agent: {ref}'s roles {tuple(roles)!r} must be two or more distinct names")
    return tuple(roles)


CLIENTS = ("openai", "anthropic")
"""The SDK clients a harness may be called with (``fn.client``): an ``openai.AsyncOpenAI`` (Chat Completions or
Responses) or an ``anthropic.AsyncAnthropic`` (Messages), each bound to the episode's session."""


def harness_client(fn: Callable, ref: str) -> str:
    """Which client a harness is called with: its function's ``client`` attribute (``rollout.client =
    "anthropic"``), or ``openai``."""
    client = getattr(fn, "client", "openai")
    if client not in CLIENTS:
        raise ConfigError(f"env.harness.agent: {ref}'s client must be one of {', '.join(CLIENTS)}, got {client!r}")
    if client != "openai" and getattr(fn, "roles", ()):
        raise ConfigError(f"env.harness.agent: {ref} plays roles, whose clients are OpenAI's; drop client = {client!r}")
    return client


async def remote_marker(client, task):
    """``env.harness.agent = "remote:PORT"``: episodes are played by harnesses in other processes (``run_harness``)."""
    raise RuntimeError("a remote harness is played over HTTP, not called")


def _remote_port(ref: str) -> int:
    _, _, port = ref.partition(":")
    if not port:
        return 8000
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"env.harness.agent = {ref!r}: write remote:PORT, e.g. remote:8000")
    return int(port)
