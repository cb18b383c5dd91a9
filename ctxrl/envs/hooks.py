"""The optional hooks an environment class may define, declared in one place, and what each one enables.

The ``Env`` protocol (``ctxrl.envs.base``) is what every environment must have. Beyond it, an environment opts
into features by defining hooks: ``shortcut``, ``redundant``, ``pretraining_variant``, ``summary``,
``failure``, ``reflection``, ``solve_after``, ``configure``, ``corpus``, ``splits``, ``check_tasks``, and a
multi-role environment's ``opponents`` and ``gold_rewards`` (their types are ``OptionalHooks``; what each
enables is ``HOOKS``), the hooks context managers declare when they register (``select``, ``folded``:
``declare_hook``), the ``names_actions`` and ``zero_sum`` flags (``FLAGS``) and the
``Settings`` dataclass of its own settings (``settings_class``; read from ``[env.NAME]``, the configured class
holds them as ``options``). ctxrl looks them up only through ``hook``, ``flag`` and ``settings_class`` here,
never with a bare ``getattr`` elsewhere, so this file is the complete list. ``ctxrl check-env NAME`` prints
which features an environment's hooks enable (``ctxrl.demos.features``).

All are class-level (static methods or classmethods), so demos and checks need no instance.
``solve(task)`` is required by the protocol; it gives warm-start demos, annealed demonstrations
(``meta.demos.source=solve``) and ``check-env``'s gold run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ctxrl.types import Message, Task


@dataclass(frozen=True)
class Hook:
    name: str
    signature: str
    enables: str
    feature: str | None = None
    """How ``features`` names what a declared hook enables (None: ``features`` does not list it)."""


HOOKS: dict[str, Hook] = {h.name: h for h in (
    Hook("shortcut", "shortcut(task) -> list[str]", "imperfect warm-start demos (sft.shortcut_fraction)"),
    Hook("redundant", "redundant(task) -> list[str]",
         "warm-start demos that make one tool call too many (sft.redundant_fraction)"),
    Hook("pretraining_variant", "pretraining_variant(seed) -> type",
         "warm-start demos from other worlds (sft.other_worlds)"),
    Hook("summary", "summary(task, messages) -> str", "warm-start demos that summarise (sft.context_demos)"),
    Hook("failure", "failure(task) -> list[str]", "trial demos (sft.trial_demos), with reflection"),
    Hook("reflection", "reflection(task, messages) -> str", "trial demos (sft.trial_demos), with failure"),
    Hook("solve_after", "solve_after(task, reflection) -> list[str]",
         "trial demos whose second attempt follows the reflection"),
    Hook("configure", "configure(data=, **its own settings) -> type",
         "environments built from data (env.data, and the class's own settings: jsonl_tools' tools, verifier)"),
    Hook("corpus", "corpus(n, seed) -> list[str]", "the tiny model's tokenizer and plain-text pre-training"),
    Hook("splits", "splits() -> tuple[str, ...]",
         "training and evaluation on the splits it has (a task file without ood tasks)"),
    Hook("check_tasks", "check_tasks(max_total_tokens, count_tokens=None) -> None",
         "tasks too long for rollout.max_total_tokens refused before anything loads (a task file's prompts)"),
    Hook("opponents", "opponents() -> dict[str, ScriptedPolicy]",
         "scripted players of a multi-role environment (roles.policies, roles.eval_opponents: scripted:NAME)",
         feature="scripted opponents (opponents)"),
    Hook("gold_rewards", "gold_rewards(task) -> dict[str, float]",
         "a multi-role environment's check-env: each seat's reward when solve(task) is played"),
)}
FLAGS = {"names_actions": "exploration statistics in the environment's own terms (note_action)",
         "zero_sum": "a multi-role environment whose seats' rewards sum to 0 (check-env verifies it)"}


class OptionalHooks(Protocol):
    """The hooks' types. An environment defines any subset of them, as static methods or classmethods."""

    @staticmethod
    def shortcut(task: Task) -> list[str]: ...

    @staticmethod
    def redundant(task: Task) -> list[str]: ...

    @classmethod
    def pretraining_variant(cls, seed: int) -> type: ...

    @staticmethod
    def summary(task: Task, messages: list[Message]) -> str: ...

    @staticmethod
    def failure(task: Task) -> list[str]: ...

    @staticmethod
    def reflection(task: Task, messages: list[Message]) -> str: ...

    @staticmethod
    def solve_after(task: Task, reflection: str) -> list[str]: ...

    @classmethod
    def configure(cls, *, data: str, tools: str, verifier: str) -> type: ...

    @classmethod
    def corpus(cls, n: int, seed: int) -> list[str]: ...

    @classmethod
    def splits(cls) -> tuple[str, ...]: ...

    @classmethod
    def check_tasks(cls, max_total_tokens: int, count_tokens: Callable[[str], int] | None = None) -> None:
        """Raise ``EnvError`` naming a task that cannot fit ``max_total_tokens`` tokens: counted with
        ``count_tokens`` (the model's tokenizer) where a caller has one, else bounded by characters."""

    @classmethod
    def opponents(cls) -> dict[str, Callable[..., str]]:
        """Named scripted players ``policy(view, rng) -> text`` (``ctxrl.envs.roles.ScriptedPolicy``)."""

    @classmethod
    def gold_rewards(cls, task: Task) -> dict[str, float]:
        """Each seat's total reward when ``solve(task)`` is played, in play order."""


def declare_hook(name: str, signature: str, enables: str, *, feature: str | None = None) -> None:
    """Add a hook to ``HOOKS``: a context manager's ``scripted_hook`` (its side requests an environment scripts) or
    ``solution_hook`` (a whole solution played under it). ``feature``: its line in ``features``, if any."""
    if name not in HOOKS:
        HOOKS[name] = Hook(name, signature, enables, feature)


def hook(env: Any, name: str) -> Callable[..., Any] | None:
    """The environment's ``name`` hook (on its class or an instance), or None if it does not define one."""
    if name not in HOOKS:
        raise KeyError(f"{name!r} is not an environment hook; known: {', '.join(HOOKS)}")
    found = getattr(env, name, None)
    return found if callable(found) else None


def flag(env: Any, name: str) -> bool:
    """An environment's boolean class attribute (``names_actions``); False when it does not set one."""
    if name not in FLAGS:
        raise KeyError(f"{name!r} is not an environment flag; known: {', '.join(FLAGS)}")
    return bool(getattr(env, name, False))


def settings_class(env: Any) -> type | None:
    """The environment's own settings, a dataclass in its class attribute ``Settings`` (``ctxrl.settings``), or
    None when it declares none."""
    found = getattr(env, "Settings", None)
    return found if isinstance(found, type) else None


def has_trial_hooks(env: Any) -> bool:
    """Whether the environment can script a failed attempt and its reflection (trial demos)."""
    return hook(env, "failure") is not None and hook(env, "reflection") is not None


def available_splits(env_cls: type) -> tuple[str, ...]:
    """The splits ``env_cls`` has tasks for: its ``splits()`` hook, or all three."""
    from ctxrl.types import SPLITS

    found = hook(env_cls, "splits")
    if found is None:
        return SPLITS
    splits = tuple(s for s in SPLITS if s in set(found()))
    return splits

