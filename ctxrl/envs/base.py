"""The environment protocol.

An environment is one small class, not a tower of base classes (STYLE lesson 6): it draws
tasks from its context space, starts an episode with ``reset``, answers each assistant
message with ``step``, and knows a scripted gold solution (``solve``) used both for SFT
warm-start data and by ``check_env``, which requires that solution to score 1.0.

Conventions every environment follows (``check_env`` tests them):

- the class can be constructed with no arguments (one instance runs one episode at a time;
  the rollout makes one instance per concurrent episode);
- ``reset`` returns ``[system, user]`` messages and is deterministic for a given task and seed;
- ``step`` is async (tools may wait on I/O), never raises because of what the model wrote,
  and raises ``EnvError`` only for misuse, e.g. stepping a finished episode;
- ``sample_tasks`` and ``solve`` are classmethods, so task sets and demos need no instance.

Optional hooks (``shortcut``, ``pretraining_variant``, ``summary``, ``failure``, ``reflection``,
``solve_after``, ``configure``, ``corpus``, the ``names_actions`` flag) are declared, with what each
enables, in ``ctxrl.envs.hooks``; ``ctxrl check-env NAME`` lists the ones an environment has.
``summary(task, messages) -> str`` is the scripted summary for warm-start demos under
``context.manager=summarize``: what a good summary holds at that point, computed from the task and
``messages``, the conversation so far (the opening, then every assistant turn and its observations,
across segments; earlier summaries are not in it). It must use only what the policy has seen, and
hold whatever ``solve``'s remaining turns need to follow from a context restarted from system +
task + summary.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from ctxrl.errors import CtxrlError
from ctxrl.tasks.space import ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.types import Message, StepResult, Task


class EnvError(CtxrlError, RuntimeError):
    """An environment that cannot be found, built or used as asked (a model's error is an observation, never this)."""

    kind = "environment error"


@runtime_checkable
class Env(Protocol):
    """What the rollout needs from an environment; see the module docstring for conventions."""

    name: ClassVar[str]
    context_space: ClassVar[ContextSpace]
    system_prompt: ClassVar[str]
    tools: list[Tool]

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        """Start an episode on ``task``; return the ``[system, user]`` messages."""
        ...

    async def step(self, message: Message) -> StepResult:
        """Answer one parsed assistant message with observations and a reward."""
        ...

    def close(self) -> None:
        """Release resources; safe to call more than once."""
        ...

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split`` (``train``, ``heldout`` or ``ood``), reproducible from ``seed``."""
        ...

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """The gold assistant turns, exactly as a model should write them."""
        ...


def pretraining_env(env_cls: type, seed: int) -> type:
    """The variant of ``env_cls`` to pre-train and warm-start on: ``env_cls.pretraining_variant(seed)`` if defined.

    An environment whose tasks share fixed facts (``search_qa``'s knowledge base) gives another
    invented world, so a base model or a warm start brings the skill (search, read, copy) and never
    the training split's answers; one whose tool is slow may replay known outputs
    (``python_math``). Environments without the hook are used as they are.
    """
    from ctxrl.envs.hooks import hook

    variant = hook(env_cls, "pretraining_variant")
    return variant(seed) if variant is not None else env_cls
