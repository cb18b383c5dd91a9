"""Find environment classes by name.

Three ways to name an environment, tried in this order:

1. ``"package.module:ClassName"`` - any importable class, no registration needed;
2. a name registered with ``@register("name")`` (built-ins are imported on first lookup);
3. a third-party package's entry point in the ``ctxrl.envs`` group, e.g. in its
   ``pyproject.toml``: ``[project.entry-points."ctxrl.envs"] maze = "mypkg.maze:MazeEnv"``.

An unknown name is an error that lists the known names and suggests the closest one.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ctxrl.envs.base import EnvError
from ctxrl.registry import Registry

ENTRY_POINT_GROUP = "ctxrl.envs"
ENVIRONMENTS: Registry[type] = Registry("environment", entry_point_group=ENTRY_POINT_GROUP, error=EnvError)
"""The built-in environments are named in the package's ``__init__`` (``Registry.add_builtins``)."""

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


def configured_env_class(name: str, settings: Mapping[str, Any] | None = None, **options: str) -> type:
    """``get_env_class(name)``, bound to ``options`` when the class takes them (``configure``), and, when it
    declares ``Settings``, a subclass whose ``options`` are those settings read from ``settings`` (its table
    ``[env.NAME]``; the same table gives the same class)."""
    cls = get_env_class(name)
    from ctxrl.envs.hooks import hook, settings_class

    configure = hook(cls, "configure")
    cls = configure(**options) if configure is not None else cls
    if settings_class(cls) is None:
        return cls
    return _with_settings(cls, f"env.{name}", json.dumps(dict(settings or {}), sort_keys=True))


@functools.cache
def _with_settings(cls: type, where: str, table: str) -> type:
    from ctxrl.envs.hooks import settings_class
    from ctxrl.settings import parse_settings

    options = parse_settings(settings_class(cls), json.loads(table), where)
    return type(cls.__name__, (cls,), {"options": options, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
