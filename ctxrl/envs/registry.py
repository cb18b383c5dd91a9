"""Find environment classes by name.

Three ways to name an environment, tried in this order:

1. ``"package.module:ClassName"`` - any importable class, no registration needed;
2. a name registered with ``@register("name")`` (built-ins are imported on first lookup);
3. a third-party package's entry point in the ``ctxrl.envs`` group, e.g. in its
   ``pyproject.toml``: ``[project.entry-points."ctxrl.envs"] maze = "mypkg.maze:MazeEnv"``.

An unknown name is an error that lists the known names and suggests the closest one.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TypeVar

from ctxrl.envs.base import EnvError

ENTRY_POINT_GROUP = "ctxrl.envs"
_BUILTIN_MODULES = ("ctxrl.envs.calculator", "ctxrl.envs.kv_chain", "ctxrl.envs.bandit", "ctxrl.envs.python_math",
                    "ctxrl.envs.search_qa", "ctxrl.envs.sokoban", "ctxrl.envs.minesweeper", "ctxrl.envs.jsonl_tools")

_REGISTRY: dict[str, type] = {}
_builtins_loaded = False

T = TypeVar("T", bound=type)


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make ``get_env_class(name)`` return the class."""

    def decorator(cls: T) -> T:
        existing = _REGISTRY.get(name)
        if existing is not None and _qualname(existing) != _qualname(cls):
            raise EnvError(f"environment name {name!r} is already registered to {_qualname(existing)}; "
                           f"pick another name for {_qualname(cls)}")
        _REGISTRY[name] = cls
        return cls

    return decorator


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def _entry_point_names() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def list_envs() -> list[str]:
    """Every name ``get_env_class`` accepts without a ``module:Class`` path."""
    _load_builtins()
    return sorted(set(_REGISTRY) | set(_entry_point_names()))


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
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    eps = _entry_point_names()
    if name in eps:
        return eps[name].load()  # type: ignore[attr-defined]
    known = sorted(set(_REGISTRY) | set(eps))
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise EnvError(f"unknown environment {name!r}; {hint}known environments: {', '.join(known) or 'none'}. "
                   "An environment outside ctxrl can be named as 'package.module:ClassName'.")


def configured_env_class(name: str, **options: str) -> type:
    """``get_env_class(name)``, bound to ``options`` when the class takes them (``configure``)."""
    cls = get_env_class(name)
    from ctxrl.envs.hooks import hook

    configure = hook(cls, "configure")
    return configure(**options) if configure is not None else cls
