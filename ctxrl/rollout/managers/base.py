"""The context-manager protocol and its registry.

A context manager decides what the model sees as an episode grows. The agent loop calls it at
three points, and it changes the episode only through the ``Recorder``:

1. ``fits(context_tokens, next_turn_tokens)``: whether the next generation fits the working budget.
   Checked on the opening (if not, the episode ends with truncation ``max_context``) and before
   each observation is appended;
2. ``make_room(play, observations, turn)``: called instead of appending ``observations`` when
   they do not fit. The manager rewrites the context (a new segment through
   ``Recorder.restart``) and returns True to go on, or sets ``episode.truncation`` and returns False;
3. ``on_assistant(play, message, turn)``: called with every closed assistant message before the
   environment steps. A manager that handles the message itself (``fold``'s ``branch`` and
   ``return`` calls) returns whether it was an error; None hands it to the environment.

``finish(play)`` runs when the episode ends, however it ends. The defaults are the ``full``
manager: everything fits, nothing is intercepted.

Adding a manager is one file: a subclass with a ``name`` and the hooks it changes, decorated
with ``@register_manager`` (or a ``ctxrl.managers`` entry point of a package). ``context.manager``
accepts every registered name, the configuration checks read the class attributes
(``uses_budget``, ``budget_optional``, ``rewrites_context``, ...), and docs/context.md shows a complete example.
Built-in managers are imported on first lookup (``ctxrl.registry``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ctxrl.engine.base import register_purpose
from ctxrl.plain import PlainData
from ctxrl.registry import Registry
from ctxrl.settings import parse_settings
from ctxrl.types import Message, Segment, Task

if TYPE_CHECKING:
    from ctxrl.engine.base import Engine
    from ctxrl.rollout.recorder import Recorder
    from ctxrl.rollout.spec import RolloutLimits

MANAGERS: Registry[type[ContextManager]] = Registry("context manager", entry_point_group="ctxrl.managers")
"""The built-in managers are named in the package's ``__init__`` (``Registry.add_builtins``)."""

M = TypeVar("M", bound="type[ContextManager]")


PHASES = ("train", "eval")


@dataclass(frozen=True)
class ContextPolicy(PlainData):
    """The context manager of a rollout, its budget, its own settings and the phase it plays in."""

    manager: str = "full"
    max_context_tokens: int = 0
    """Working-context budget in tokens (managers with ``uses_budget``, or ``budget_optional`` ones); 0 = unlimited."""
    options: dict[str, Any] = field(default_factory=dict)
    """The manager's own table (``[context.NAME]``, as the configuration read it), which the manager reads into
    its ``Settings`` (``ContextManager.options``); empty: its defaults (or nothing, for a manager without any)."""
    phase: str = "train"
    """``train`` or ``eval``: a setting may differ between them (``summarize``'s ``eval_max_summaries``)."""

    def __post_init__(self) -> None:
        cls = get_manager(self.manager)  # an unknown name is an error that lists the known ones
        if cls.uses_budget and self.max_context_tokens <= 0:
            raise ValueError(f"the {self.manager} context manager needs max_context_tokens > 0")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, not {self.phase!r}")

    def make(self) -> ContextManager:
        """A fresh manager for one episode."""
        return get_manager(self.manager)(self)


@dataclass
class Play:
    """What a manager may use during one episode: its recorder, the engine and limits, its seed and opening."""

    recorder: Recorder
    engine: Engine
    limits: RolloutLimits
    seed: int | None
    opening: list[Message]

    @property
    def episode(self):
        return self.recorder.episode


class ContextManager:
    """The ``full`` behaviour; a registered subclass changes what it needs (see the module docstring)."""

    name: ClassVar[str] = ""
    uses_budget: ClassVar[bool] = False
    """Whether it keeps the context within ``max_context_tokens`` (``fits`` then checks that budget) and needs one."""
    budget_optional: ClassVar[bool] = False
    """Whether it keeps the context within ``max_context_tokens`` when one is set (> 0) and runs without a budget
    at 0 (``fold``). ``keeps_budget`` says which applies; the budget's checks and curriculum follow it."""
    rewrites_context: ClassVar[bool] = False
    """Whether it cuts episodes into segments: training then needs one advantage per episode, broadcast to
    its segments (an outcome estimator) and ``token-mean`` aggregation."""
    scripted_hook: ClassVar[str | None] = None
    """The purpose of this manager's side requests (``summarize``: ``summary``), which is also the name of
    the environment hook that answers them in scripted demonstrations; None if it makes none. With the
    hook, warm-start demos can play under the manager."""
    solution_hook: ClassVar[str | None] = None
    """The environment hook that scripts a whole solution played under this manager (``fold``: ``folded``, whose
    turns branch and return), used in place of ``solve`` for warm-start demos; None if ``solve`` serves."""
    tool_schemas: ClassVar[list[dict[str, Any]]] = []
    """Tools the manager offers the policy besides the environment's (``fold``: branch and return)."""
    Settings: ClassVar[type | None] = None
    """The manager's own settings, a dataclass read from its table ``[context.NAME]`` (``ctxrl.settings``)."""

    def __init__(self, policy: ContextPolicy) -> None:
        self.policy = policy
        self.options = self.options_of(policy)
        """An instance of ``Settings`` (from ``policy.options``, else its defaults), or None."""

    @classmethod
    def options_of(cls, policy: ContextPolicy) -> Any:
        """``policy.options`` read into the manager's ``Settings`` (parsed once per table), or None without any."""
        if cls.Settings is None:
            return None
        return _settings(cls.Settings, f"context.{cls.name}", json.dumps(policy.options, sort_keys=True))

    def fits(self, context_tokens: int, next_turn_tokens: int) -> bool:
        """Whether a context of ``context_tokens`` leaves room for a turn of ``next_turn_tokens``."""
        budget = self.policy.max_context_tokens
        return not self.keeps_budget(budget) or context_tokens + next_turn_tokens <= budget

    @classmethod
    def keeps_budget(cls, max_context_tokens: int) -> bool:
        """Whether, given ``context.max_context_tokens``, it keeps a working-context budget: ``fits`` checks it,
        the budget's config checks and curriculum apply, the trainer logs ``context_budget``."""
        return cls.uses_budget or (cls.budget_optional and max_context_tokens > 0)

    async def on_assistant(self, play: Play, message: Message, turn: int) -> bool | None:
        """Handle ``message`` instead of the environment (return whether it was an error), or None."""
        return None

    async def make_room(self, play: Play, observations: list[Message], turn: int) -> bool:
        """Rewrite the context so that the next turn fits; False ends the episode (truncation set)."""
        play.episode.truncation = "max_context"
        return False

    def finish(self, play: Play) -> None:
        """The episode ended (any way); leave the episode's live sequence as the one it continued in."""

    @classmethod
    def segment_bonus(cls, segment: Segment, policy: ContextPolicy) -> float:
        """An extra advantage for every sampled token of ``segment`` (a process reward; 0 by default)."""
        return 0.0

    @classmethod
    def demo_script(cls, env_cls: type) -> Callable[[Task, list[Message]], str] | None:
        """What answers this manager's side requests in scripted demos, given the task and the conversation so
        far: the environment's hook named ``scripted_hook``; None when it has none (no demos under the manager)."""
        if cls.scripted_hook is None:
            return None
        from ctxrl.envs.hooks import hook

        return hook(env_cls, cls.scripted_hook)

    @classmethod
    def demo_solution(cls, env_cls: type) -> Callable[[Task], list[str]] | None:
        """What scripts a whole demo under this manager: the environment's hook named ``solution_hook``; None when
        the manager has none (``solve`` serves) or the environment lacks it."""
        if cls.solution_hook is None:
            return None
        from ctxrl.envs.hooks import hook

        return hook(env_cls, cls.solution_hook)

    @classmethod
    def scripts_demos(cls) -> bool:
        """Whether its warm-start demos differ from full-context ones (a ``scripted_hook`` or a ``solution_hook``)."""
        return cls.scripted_hook is not None or cls.solution_hook is not None

    @classmethod
    def demo_ready(cls, env_cls: type) -> bool:
        """Whether ``env_cls`` has every hook that demos under this manager need."""
        return ((cls.scripted_hook is None or cls.demo_script(env_cls) is not None)
                and (cls.solution_hook is None or cls.demo_solution(env_cls) is not None))

    @classmethod
    def demo_hooks(cls) -> str:
        """The environment hooks its demos use, for error messages: ``summary(task, messages)``, ``folded(task)``."""
        hooks = [f"{cls.scripted_hook}(task, messages)"] if cls.scripted_hook is not None else []
        if cls.solution_hook is not None:
            hooks.append(f"{cls.solution_hook}(task)")
        return " and ".join(hooks)


def register_manager(cls: M) -> M:
    """Class decorator: make ``context.manager = cls.name`` choose ``cls``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} needs a class attribute name to register as a context manager")
    MANAGERS.register(cls.name, cls)
    if cls.scripted_hook is not None:
        from ctxrl.envs.hooks import declare_hook

        register_purpose(cls.scripted_hook)  # its side requests are generated with this purpose
        declare_hook(cls.scripted_hook, f"{cls.scripted_hook}(task, messages) -> str",
                     f"warm-start demos under context.manager={cls.name} (sft.context_demos)")
    if cls.solution_hook is not None:
        from ctxrl.envs.hooks import declare_hook

        declare_hook(cls.solution_hook, f"{cls.solution_hook}(task) -> list[str]",
                     f"warm-start demos played under context.manager={cls.name} (sft.context_demos)",
                     feature=f"demos played under {cls.name} ({cls.solution_hook})")
    return cls


def manager_names() -> list[str]:
    """Every registered context manager, built-ins first."""
    return MANAGERS.names()


@functools.cache
def _settings(cls: type, where: str, table: str) -> Any:
    """A manager's ``Settings`` from its table, parsed once per table (a manager is made for every episode)."""
    return parse_settings(cls, json.loads(table), where)


def get_manager(name: str) -> type[ContextManager]:
    """The manager class registered as ``name``; an unknown name is an error listing the known ones."""
    return MANAGERS.get(name)
