"""Several agents in one episode: the multi-role environment protocol, seats, and the one-role case.

A multi-role environment seats several agents at one table (docs/multi-agent.md). It declares its
``roles``; ``reset`` returns every seat's opening, keyed by seat; ``to_act()`` names the one seat whose
turn it is; ``step(message)`` takes that seat's parsed message and returns a ``TableStep``: what each seat
reads next, what each earned, and, at the end, who won. A seat is named after its role, or ``ROLE/K``
when a role has several seats (four solvers of one proposed problem). ``view(seat)`` is what that seat
knows, the input of the environment's scripted policies (``opponents()``).

The single-agent protocol (``ctxrl.envs.base.Env``) is the one-role case: ``OneSeat(env)`` presents a
single-agent environment as a table of one seat, ``agent``, and the match loop playing it records exactly
what the agent loop records (``tests/test_roles.py``). Single-agent environments are still played by the
agent loop; nothing here changes them.

What this file does not do: play a match (``ctxrl.rollout.match``), or decide who plays a role
(``roles.policies``, ``ctxrl.sections.RolesConfig.policy``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

from ctxrl.tasks.space import ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.types import Message, TableStep, Task

ONE_ROLE = "agent"
"""The role of a single-agent environment's one seat."""
SEAT_SEPARATOR = "/"

ScriptedPolicy = Callable[[dict[str, Any], random.Random], str]
"""A scripted player: ``policy(view, rng) -> text``, from what its seat knows (``view(seat)``) and a seeded
random stream; its text is parsed and stepped as a sampled turn would be."""


@runtime_checkable
class MultiRoleEnv(Protocol):
    """What the match loop needs from a multi-role environment (see the module docstring)."""

    name: ClassVar[str]
    roles: ClassVar[tuple[str, ...]]
    context_space: ClassVar[ContextSpace]
    system_prompt: ClassVar[str]
    tools: list[Tool]

    def reset(self, task: Task, *, seed: int | None = None) -> dict[str, list[Message]]:
        """Start a match on ``task``: every seat's opening ``[system, user]``, keyed by seat."""
        ...

    def to_act(self) -> str:
        """The seat whose turn it is."""
        ...

    async def step(self, message: Message) -> TableStep:
        """Answer the acting seat's parsed message."""
        ...

    def view(self, seat: str) -> dict[str, Any]:
        """What ``seat`` knows now (its private information and the public history): a scripted policy's input."""
        ...

    def close(self) -> None:
        ...

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        ...

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Every seat's scripted turns, in the order the seats act."""
        ...

    @classmethod
    def gold_rewards(cls, task: Task) -> dict[str, float]:
        """Each seat's total reward when ``solve(task)`` is played (``check_env`` verifies it)."""
        ...


def plays(*roles: str) -> Callable[[ScriptedPolicy], ScriptedPolicy]:
    """Decorator: the roles a scripted policy can play (one that only proposes problems cannot solve them);
    a policy without it plays every role (``playable``)."""

    def mark(policy: ScriptedPolicy) -> ScriptedPolicy:
        policy.roles = tuple(roles)  # type: ignore[attr-defined]
        return policy

    return mark


def playable(policy: Any, role: str) -> bool:
    """Whether a scripted ``policy`` can play ``role`` (see ``plays``); any other policy plays every role."""
    roles = getattr(policy, "roles", None)
    return roles is None or role in roles


def is_multi_role(env: Any) -> bool:
    """Whether ``env`` (a class or an instance) declares roles: a table of several seats."""
    return bool(getattr(env, "roles", ()))


def roles_of(env: Any) -> tuple[str, ...]:
    """The roles ``env`` declares, or the one role of a single-agent environment."""
    return tuple(getattr(env, "roles", ())) or (ONE_ROLE,)


def seat_role(seat: str) -> str:
    """The role a seat plays: its name, up to ``/`` (``solver/2`` plays ``solver``)."""
    return seat.split(SEAT_SEPARATOR, 1)[0]


def seat_name(role: str, k: int | None = None) -> str:
    """The name of seat ``k`` of ``role`` (None: the role's only seat)."""
    return role if k is None else f"{role}{SEAT_SEPARATOR}{k}"


def opponents_of(env: Any) -> dict[str, ScriptedPolicy]:
    """The environment's named scripted policies (its ``opponents()`` hook), or none."""
    from ctxrl.envs.hooks import hook

    found = hook(env, "opponents")
    return dict(found()) if found is not None else {}


class OneSeat:
    """A single-agent environment as a table of one seat, ``agent``: the one-role case of the protocol."""

    roles: ClassVar[tuple[str, ...]] = (ONE_ROLE,)

    def __init__(self, env: Any) -> None:
        self.env = env
        self.tools = env.tools

    def reset(self, task: Task, *, seed: int | None = None) -> dict[str, list[Message]]:
        return {ONE_ROLE: self.env.reset(task, seed=seed)}

    def to_act(self) -> str:
        return ONE_ROLE

    async def step(self, message: Message) -> TableStep:
        result = await self.env.step(message)
        return TableStep(messages={ONE_ROLE: list(result.messages)}, rewards={ONE_ROLE: float(result.reward)},
                         terminated=result.terminated, truncated=result.truncated, info=dict(result.info))

    def view(self, seat: str) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.env.close()
