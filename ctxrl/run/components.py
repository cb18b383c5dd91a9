"""The tables of registered components' own settings: which class reads ``[algo.NAME]``, ``[context.NAME]``,
``[env.NAME]``, and the table as that class reads it.

A component (an estimator, a context manager, an environment) that has knobs of its own declares them as a
``Settings`` dataclass (``ctxrl.settings``); its table lives inside its section. This module finds that class
through the section's registry, so it imports the registries, lazily: ``ctxrl.config`` reaches it only when a
config is checked or a component's settings are asked for, never when a ``Config`` is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ctxrl.errors import ConfigError, CtxrlError
from ctxrl.settings import parse_settings, settings_table

if TYPE_CHECKING:
    from ctxrl.config import Config


def estimator_class(name: str) -> type:
    from ctxrl.algo.estimators import get_estimator

    return get_estimator(name)


def manager_class(name: str) -> type:
    from ctxrl.rollout.managers import get_manager

    return get_manager(name)


def env_class(name: str) -> type:
    from ctxrl.envs.registry import get_env_class

    return get_env_class(name)


COMPONENT_REGISTRIES = {"algo": estimator_class, "context": manager_class, "env": env_class}
"""The sections whose sub-tables are registered components' own settings, and the registry each is looked up in."""


def settings_class(section: str, name: str) -> type | None:
    """The ``Settings`` dataclass the component ``name`` of ``section`` declares (an environment's through its
    hooks' ``settings_class``), or None."""
    if section == "env":  # (a family of environments has one table for all: [env.reasoning_gym])
        from ctxrl.envs.registry import env_settings_class

        return env_settings_class(name)
    cls = COMPONENT_REGISTRIES[section](name)
    settings = getattr(cls, "Settings", None)
    return settings if isinstance(settings, type) else None


def component_table(key: str, table: Any) -> dict[str, Any]:
    """The table of ``key`` (``algo.NAME``) parsed by its component's ``Settings``, as a table with every field, or
    a ``ConfigError`` naming the problem (no such component, a component without settings, a wrong key)."""
    section, _, name = key.partition(".")
    if not isinstance(table, dict):
        raise ConfigError(f"[{key}] must be a table of the settings of {section} component {name!r}, got {table!r}")
    try:
        settings = settings_class(section, name)
    except (ValueError, LookupError, CtxrlError) as exc:  # (an unknown environment is an EnvError)
        raise ConfigError(f"[{key}]: {exc}") from None
    if settings is None:
        raise ConfigError(f"[{key}]: {section} component {name!r} has no settings of its own (its class declares no "
                          "Settings); set the section's own fields instead")
    return settings_table(parse_settings(settings, table, key))


def settings_of(config: Config, section: str, name: str) -> Any:
    """The ``Settings`` of the component registered as ``name`` in ``section`` (``algo``: estimators,
    ``context``: context managers, ``env``: environments), from ``config``'s table or its defaults; None when the
    component declares none. An environment of a family (``reasoning_gym:chain_sum``) reads its family's table."""
    if section == "env":
        from ctxrl.envs.registry import settings_name

        name = settings_name(name)
    cls = settings_class(section, name)
    if cls is None:
        return None
    return parse_settings(cls, config.components.get(f"{section}.{name}", {}), f"{section}.{name}")
