"""``Registry``: names for extension points (environments, context managers, advantage estimators).

Each kind of extension point has one registry. A class joins it by name when its module is
imported (a decorator calls ``register``); built-in modules are imported the first time the
registry is read, and a third-party package can join through a Python entry point in the
registry's group (``[project.entry-points."ctxrl.managers"] mine = "mypkg.mine:Mine"``), loaded
when its name is first asked for. Built-ins come first in ``names()``, whoever registered first.

The built-ins import the module that holds their registry (to register), so that module must not
name them: their package's ``__init__``, which Python runs before any module of the package, names
them with ``add_builtins``. No module then imports one that imports it back.

A name taken by another class is an error naming both; an unknown name is an error that lists
the known ones and suggests the closest. The configuration reads ``names()`` for its choices, so
a name is defined once, where the class is.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named classes of one kind (see the module docstring)."""

    def __init__(self, kind: str, builtins: tuple[str, ...] = (), *, entry_point_group: str,
                 error: Callable[[str], Exception] = ValueError) -> None:
        self.kind = kind
        self.builtins = builtins
        self.entry_point_group = entry_point_group
        self.error = error
        self._entries: dict[str, T] = {}
        self._loaded = False

    def add_builtins(self, *modules: str) -> None:
        """Name more built-in modules, imported after those named before, the first time the registry is read
        (from the package above the registry's module and its built-ins: see the module docstring)."""
        self.builtins = (*self.builtins, *modules)
        self._loaded = False

    def load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True  # first: the built-in modules register themselves through this registry
            for module in self.builtins:
                importlib.import_module(module)

    def register(self, name: str, cls: T) -> T:
        """Add ``cls`` as ``name``; re-registering the same class (a reloaded module) is allowed."""
        self.load_builtins()
        existing = self._entries.get(name)
        if existing is not None and _qualname(existing) != _qualname(cls):
            raise self.error(f"{self.kind} name {name!r} is already registered to {_qualname(existing)}; "
                             f"pick another name for {_qualname(cls)}")
        self._entries[name] = cls
        return cls

    def names(self) -> list[str]:
        """Every registered name: the built-ins in the order their modules are named (whichever module happened to
        be imported first), then other registrations in their order, then entry points not loaded yet."""
        self.load_builtins()
        order = {module: i for i, module in enumerate(self.builtins)}
        entries = sorted(self._entries, key=lambda n: order.get(getattr(self._entries[n], "__module__", ""),
                                                                len(order)))  # (stable: a module's own order kept)
        return [*entries, *(n for n in self._entry_points() if n not in self._entries)]

    def builtin_names(self) -> list[str]:
        """The names the built-in modules registered, in their order: what ctxrl itself ships (the configuration
        reference documents their settings; a plugin's or an entry point's are its own to document)."""
        builtins = set(self.builtins)
        return [n for n in self.names() if getattr(self._entries.get(n), "__module__", None) in builtins]

    def get(self, name: str) -> T:
        """The class registered as ``name`` (loading its entry point if need be)."""
        self.load_builtins()
        if name not in self._entries:
            point = self._entry_points().get(name)
            if point is not None:
                self._entries[name] = point.load()
        if name not in self._entries:
            known = self.names()
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise self.error(f"unknown {self.kind} {name!r}; {hint}known {self.kind}s: {', '.join(known) or 'none'}")
        return self._entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def _entry_points(self) -> dict:
        return {ep.name: ep for ep in entry_points(group=self.entry_point_group)}


def _qualname(cls: object) -> str:
    return f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', repr(cls))}"
