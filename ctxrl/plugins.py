"""Your own environments, context managers and estimators: modules imported before a config is checked.

Extension points register themselves when their module is imported (``@register``,
``@register_manager``, ``@register_estimator``). ``run.plugins`` names those modules
(comma-separated), and ``import_plugins`` imports them before the configuration is validated,
so that ``context.manager = "mine"`` or ``algo.advantage = "mine"`` resolves in ``ctxrl train``
exactly as a built-in would. A module is looked up on ``sys.path`` and in the working directory
(``ctxrl`` is a console script, whose ``sys.path`` does not hold the directory it is run from).
Worker processes import the same list before they read their spec.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from ctxrl.errors import ConfigError


def plugin_names(plugins: str) -> list[str]:
    """The module names of a ``run.plugins`` value."""
    return [name.strip() for name in plugins.split(",") if name.strip()]


def import_plugins(plugins: str) -> None:
    """Import every module ``plugins`` names; a clear ``ConfigError`` for one that cannot be imported."""
    names = plugin_names(plugins)
    if names and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"run.plugins: cannot import module {name!r} ({exc}); give an importable module "
                              "name, on PYTHONPATH or in the directory ctxrl runs in") from None


def import_file(path: Path, prefix: str) -> ModuleType:
    """The module in Python file ``path``, imported as ``PREFIX_STEM`` and kept in ``sys.modules`` (its classes'
    dataclasses and pickles look their module up there); the caller checks that the file exists."""
    spec = importlib.util.spec_from_file_location(f"{prefix}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
