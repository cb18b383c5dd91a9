"""Find environment classes by name.

Three ways to name an environment, tried in this order:

1. ``"package.module:ClassName"`` - any importable class, no registration needed;
2. a name registered with ``@register("name")`` (built-ins are imported on first lookup);
3. a third-party package's entry point in the ``ctxrl.envs`` group, e.g. in its
   ``pyproject.toml``: ``[project.entry-points."ctxrl.envs"] maze = "mypkg.maze:MazeEnv"``.

An unknown name is an error that lists the known names and suggests the closest one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from ctxrl.envs.base import EnvError
from ctxrl.registry import Registry

ENTRY_POINT_GROUP = "ctxrl.envs"
ENVIRONMENTS: Registry[type] = Registry(
    "environment", ("ctxrl.envs.calculator", "ctxrl.envs.kv_chain", "ctxrl.envs.fact_hunt", "ctxrl.envs.search_join",
                    "ctxrl.envs.bandit",
                    "ctxrl.envs.python_math", "ctxrl.envs.search_qa", "ctxrl.envs.sokoban", "ctxrl.envs.minesweeper",
                    "ctxrl.envs.codebreak", "ctxrl.envs.hidden_word", "ctxrl.envs.jsonl_tools", "ctxrl.serve.harness"),
    entry_point_group=ENTRY_POINT_GROUP, error=EnvError)

T = TypeVar("T", bound=type)


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make ``get_env_class(name)`` return the class."""

    def decorator(cls: T) -> T:
        return ENVIRONMENTS.register(name, cls)

    return decorator


def list_envs() -> list[str]:
    """Every name ``get_env_class`` accepts without a ``module:Class`` path."""
    return sorted(ENVIRONMENTS.names())


def get_env_class(name: str) -> type:
    """The environment class for a registered name, an entry point, or ``"module:Class"``."""
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise EnvError(f"cannot import module {module_name!r} for environment {name!r}: {exc}") from exc
        try:
            return getattr(module, class_name)
        except AttributeError:
            raise EnvError(f"module {module_name!r} has no class {class_name!r}") from None
    try:
        return ENVIRONMENTS.get(name)
    except EnvError as exc:
        raise EnvError(f"{exc}. An environment outside ctxrl can be named as 'package.module:ClassName'.") from None


def configured_env_class(name: str, **options: str) -> type:
    """``get_env_class(name)``, bound to ``options`` when the class takes them (``configure``)."""
    cls = get_env_class(name)
    from ctxrl.envs.hooks import hook

    configure = hook(cls, "configure")
    return configure(**options) if configure is not None else cls
