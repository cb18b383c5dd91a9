"""The tables of registered components' own settings: which class reads ``[algo.NAME]``, ``[context.NAME]``,
``[env.NAME]``, ``[curriculum.NAME]``, and the table as that class reads it.

A component (an estimator, a context manager, an environment) that has knobs of its own declares them as a
``Settings`` dataclass (``ctxrl.settings``); its table lives inside its section. ``COMPONENT_REGISTRIES`` says, per
section, where a component's settings class is found: through the section's registry (``Registered``: the class
registered under that name declares ``Settings``), or in a fixed map of a few names to their settings classes
(``Fixed``, for a section whose components are not a registry's). A new section with tables is one entry here.

This module imports the registries, lazily: ``ctxrl.config`` reaches it only when a config is checked or a
component's settings are asked for, never when a ``Config`` is built.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ctxrl.errors import ConfigError, CtxrlError
from ctxrl.settings import parse_settings, resumable, settings_table

if TYPE_CHECKING:
    from ctxrl.config import Config


@dataclass(frozen=True)
class Registered:
    """A section whose components are a registry's classes: ``lookup(name)`` is the settings dataclass the class
    registered as ``name`` declares (None without one; an unknown name raises the registry's error), and
    ``builtins()`` the names ctxrl itself registers, whose tables the configuration reference lists."""

    lookup: Callable[[str], type | None]
    builtins: Callable[[], list[str]]


@dataclass(frozen=True)
class Fixed:
    """A section whose components are a fixed few: each name and its settings dataclass as ``"module:Class"``."""

    tables: dict[str, str]

    def lookup(self, name: str) -> type:
        if name not in self.tables:
            raise LookupError(f"no component {name!r} has a table here; the tables are {', '.join(self.tables)}")
        module, _, cls = self.tables[name].partition(":")
        return getattr(importlib.import_module(module), cls)

    def builtins(self) -> list[str]:
        return list(self.tables)


def _declared(cls: type) -> type | None:
    settings = getattr(cls, "Settings", None)
    return settings if isinstance(settings, type) else None


def _algo_settings(name: str) -> type | None:
    """``[algo.NAME]``: an estimator's settings, else a policy loss's, else an off-policy correction's (a name is one of
    them: the registries refuse none, and a test checks the built-ins apart); an unknown name lists them all."""
    from ctxrl.algo.estimators import estimator_names, get_estimator
    from ctxrl.algo.offpolicy import OFFPOLICY_CORRECTIONS, correction_settings, offpolicy_correction_names
    from ctxrl.algo.policy_losses import POLICY_LOSSES, declared, get_policy_loss, policy_loss_names

    if name in estimator_names():
        return _declared(get_estimator(name))
    if name in POLICY_LOSSES:
        return declared(get_policy_loss(name)).Settings
    if name in OFFPOLICY_CORRECTIONS:
        return correction_settings(name)
    try:
        get_estimator(name)
    except ValueError as exc:  # the estimators' own message (with its nearest name), then the others
        raise LookupError(f"{exc}; nor a policy loss: {', '.join(policy_loss_names())}; nor an off-policy "
                          f"correction: {', '.join(offpolicy_correction_names())}") from None
    raise AssertionError(name)  # (not reached: the name is no estimator)


def _builtin_algo() -> list[str]:
    from ctxrl.algo.estimators.base import ESTIMATORS
    from ctxrl.algo.offpolicy import OFFPOLICY_CORRECTIONS
    from ctxrl.algo.policy_losses import POLICY_LOSSES

    return [*ESTIMATORS.builtin_names(), *POLICY_LOSSES.builtin_names(), *OFFPOLICY_CORRECTIONS.builtin_names()]


def _manager_settings(name: str) -> type | None:
    from ctxrl.rollout.managers import get_manager

    return _declared(get_manager(name))


def _builtin_managers() -> list[str]:
    from ctxrl.rollout.managers.base import MANAGERS

    return MANAGERS.builtin_names()


def _curriculum_settings(name: str) -> type | None:
    from ctxrl.tasks.curriculum import get_curriculum

    return _declared(get_curriculum(name))


def _builtin_curricula() -> list[str]:
    from ctxrl.tasks.curriculum import CURRICULA

    return CURRICULA.builtin_names()


def _env_settings(table: str) -> type | None:  # (a family of environments has one table for all: [env.reasoning_gym])
    from ctxrl.envs.registry import env_settings_class

    return env_settings_class(table)


def _builtin_envs() -> list[str]:
    from ctxrl.envs.registry import ENVIRONMENTS, SCHEMES

    return [*ENVIRONMENTS.builtin_names(), *(p for p, module in SCHEMES.items() if module.startswith("ctxrl."))]


COMPONENT_REGISTRIES: dict[str, Registered | Fixed] = {
    "algo": Registered(_algo_settings, _builtin_algo),
    "context": Registered(_manager_settings, _builtin_managers),
    "env": Registered(_env_settings, _builtin_envs),
    "curriculum": Registered(_curriculum_settings, _builtin_curricula),
    "reward": Fixed({"judge": "ctxrl.judge.spec:JudgeSettings"}),
    "meta": Fixed({"demos": "ctxrl.meta.anneal:DemoSettings"}),
}
"""The sections whose sub-tables are components' own settings, and where each finds a component's settings."""


def env_class(name: str) -> type:
    from ctxrl.envs.registry import get_env_class

    return get_env_class(name)


def settings_class(section: str, name: str) -> type | None:
    """The ``Settings`` dataclass of the component ``name`` of ``section``, or None when it declares none."""
    return COMPONENT_REGISTRIES[section].lookup(name)


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
    fields = set() if settings is None else {f.name for f in dataclasses.fields(settings)}
    for field_name in table:
        tables = [t for t in owners(section, field_name) if t != key] if field_name not in fields else []
        if tables:
            raise ConfigError(f"{key}.{field_name} is not a setting of [{key}]; {field_name} is a setting of "
                              f"{' and '.join(f'[{t}]' for t in tables)}")
    if settings is None:
        raise ConfigError(f"[{key}]: {section} component {name!r} has no settings of its own (its class declares no "
                          "Settings); set the section's own fields instead")
    return settings_table(parse_settings(settings, table, key))


def owners(section: str, field_name: str) -> list[str]:
    """The tables (``algo.NAME``) of ``section``'s built-in components whose settings have a field ``field_name``:
    where a key set in the wrong table belongs."""
    where = COMPONENT_REGISTRIES.get(section)
    if where is None:
        return []
    found = []
    for name in where.builtins():
        settings = where.lookup(name)
        if settings is not None and field_name in {f.name for f in dataclasses.fields(settings)}:
            found.append(f"{section}.{name}")
    return found


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


def builtin_tables() -> list[tuple[str, type]]:
    """``(section.NAME, its Settings dataclass)`` of every component ctxrl itself ships that declares settings, in
    the order of the sections, then of their registries."""
    out = []
    for section, where in COMPONENT_REGISTRIES.items():
        for name in where.builtins():
            settings = where.lookup(name)
            if settings is not None:
                out.append((f"{section}.{name}", settings))
    return out


def resumable_fields(cls: type) -> list[str]:
    """The fields of the settings dataclass ``cls`` that may change on ``--resume`` (``ctxrl.settings.RESUMABLE``)."""
    return [f.name for f in dataclasses.fields(cls) if resumable(cls, f)]
