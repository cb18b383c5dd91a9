"""Find environment classes by name.

Four ways to name an environment, tried in this order:

1. ``"PREFIX:NAME"`` where ``PREFIX`` is a family of environments that another package provides
   (``SCHEMES``: ``reasoning_gym:chain_sum``, ``verifiers:my_env``);
2. ``"package.module:ClassName"`` - any importable class, no registration needed;
3. a name registered with ``@register("name")`` (built-ins are imported on first lookup);
4. a third-party package's entry point in the ``ctxrl.envs`` group, e.g. in its
   ``pyproject.toml``: ``[project.entry-points."ctxrl.envs"] maze = "mypkg.maze:MazeEnv"``.

An environment's own settings are read from its table ``[env.NAME]``; a family's from ``[env.PREFIX]``, one
table for every environment of the family (``settings_name``).

An unknown name is an error that lists the known names and suggests the closest one.
"""

from __future__ import annotations

import dataclasses
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

SCHEMES: dict[str, str] = {}
"""Families of environments another package provides, by the prefix of their names: ``PREFIX`` -> the ctxrl module
that adapts them. That module defines ``environment(rest) -> type``, the class ``PREFIX:REST`` names (built once),
and ``Settings``, the family's own settings (the table ``[env.PREFIX]``). It imports the other package only when
``environment`` runs, so a package that is not installed is an error naming its extra then, and importing ctxrl
never needs it. The built-in families are named in the package's ``__init__`` (``add_scheme``)."""


def add_scheme(prefix: str, module: str) -> None:
    """Make ``get_env_class("PREFIX:REST")`` return ``module.environment(REST)`` (see ``SCHEMES``)."""
    SCHEMES[prefix] = module


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make ``get_env_class(name)`` return the class."""

    def decorator(cls: T) -> T:
        return ENVIRONMENTS.register(name, cls)

    return decorator


def list_envs() -> list[str]:
    """Every name ``get_env_class`` accepts without a ``module:Class`` path."""
    return sorted(ENVIRONMENTS.names())


def settings_name(name: str) -> str:
    """The name of the table an environment's own settings are read from, after ``env.``: its name, or its
    family's prefix (``reasoning_gym:chain_sum`` -> ``reasoning_gym``)."""
    prefix, sep, _ = name.partition(":")
    return prefix if sep and prefix in SCHEMES else name


def env_settings_class(table: str) -> type | None:
    """The ``Settings`` dataclass of the table ``[env.TABLE]``: a family's (``TABLE`` is a prefix of ``SCHEMES``), or
    that of the environment ``TABLE`` names; None when it declares none."""
    from ctxrl.envs.hooks import settings_class

    if table in SCHEMES:
        return importlib.import_module(SCHEMES[table]).Settings
    if settings_name(table) != table:
        prefix = settings_name(table)
        raise EnvError(f"the settings of every {prefix} environment are in one table, [env.{prefix}] "
                       f"(env.{prefix}.KEY=VALUE on the command line), not [env.\"{table}\"]")
    return settings_class(get_env_class(table))


def get_env_class(name: str) -> type:
    """The environment class for a family's ``"PREFIX:NAME"``, a registered name, an entry point, or
    ``"module:Class"``."""
    prefix, sep, rest = name.partition(":")
    if sep and prefix in SCHEMES:
        return importlib.import_module(SCHEMES[prefix]).environment(rest)
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
        if name in SCHEMES:
            raise EnvError(f"{name!r} names a family of environments: write {name}:NAME (docs/environments.md)") \
                from None
        raise EnvError(f"{exc}. An environment outside ctxrl can be named as 'package.module:ClassName'; "
                       f"families: {', '.join(f'{p}:NAME' for p in sorted(SCHEMES))}.") from None


def configured_env_class(name: str, settings: Mapping[str, Any] | None = None, **options: str) -> type:
    """``get_env_class(name)``, bound to ``options`` (``data``) when the class takes them (``configure``), and, when
    it declares ``Settings``, a subclass whose ``options`` are those settings read from ``settings`` (its table
    ``[env.NAME]``; the same table gives the same class). A class with both is configured with its settings' fields
    too (``jsonl_tools``: ``tools``, ``verifier``; an explicit keyword in ``options`` wins)."""
    cls = get_env_class(name)
    from ctxrl.envs.hooks import hook, settings_class

    table, where = json.dumps(dict(settings or {}), sort_keys=True), f"env.{settings_name(name)}"
    configure = hook(cls, "configure")
    if configure is not None:
        declared = settings_class(cls)
        own = {} if declared is None else dataclasses.asdict(_parsed(declared, where, table))
        cls = configure(**{**own, **options})
    if settings_class(cls) is None:
        return cls
    return _with_settings(cls, where, table)


@functools.cache
def _parsed(declared: type, where: str, table: str) -> Any:
    from ctxrl.settings import parse_settings

    return parse_settings(declared, json.loads(table), where)


@functools.cache
def _with_settings(cls: type, where: str, table: str) -> type:
    from ctxrl.envs.hooks import settings_class

    options = _parsed(settings_class(cls), where, table)
    configured = type(cls.__name__, (cls,), {"options": options, "__module__": cls.__module__,
                                             "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    check = getattr(configured, "check_options", None)
    if check is not None:  # what the settings mean for this environment (a range of a param it has)
        from ctxrl.errors import ConfigError

        try:
            check()
        except ValueError as exc:
            raise ConfigError(f"[{where}]: {exc}") from None
    return configured
