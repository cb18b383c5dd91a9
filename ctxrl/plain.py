"""Dataclasses to plain JSON values and back, exactly: what lets episodes and specs cross a process boundary.

``to_plain(obj)`` turns a dataclass (nested dataclasses, lists, tuples, dicts of JSON values) into
dicts and lists; ``from_plain(cls, data)`` rebuilds it from the field types, so a list of
``Message`` comes back as ``Message`` objects and a ``tuple[int, ...]`` as a tuple. Floats survive
``json.dumps`` / ``json.loads`` unchanged (Python writes the shortest text that reads back as the
same double, ``NaN`` and ``Infinity`` included). ``to_json`` / ``from_json`` wrap both. ``project(cls, source)``
builds one dataclass from the same-named fields of another.

What it does not do: arbitrary objects, tensors, dict keys that are not strings, or unions of
structured types (which one to rebuild?). A value it cannot represent is a ``TypeError`` naming
the field, never a silent ``str()``. A tuple inside a field typed ``Any`` comes back as a list (JSON
has no tuples): values in such fields (``Task.data``, ``Episode.info``) should be lists, and
``check-env`` checks that an environment's tasks round-trip.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar, Union

T = TypeVar("T")


def to_plain(obj: Any, where: str = "value") -> Any:
    """``obj`` as dicts, lists and JSON scalars (dataclasses by field name)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict key {k!r} is not a string; plain data has string keys only")
            out[k] = to_plain(v, f"{where}.{k}")
        return out
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{where}: a {type(obj).__name__} is not plain data (dataclasses, lists, dicts, JSON scalars)")


def from_plain(cls: Any, data: Any, where: str | None = None) -> Any:
    """Rebuild a value of type ``cls`` (a dataclass or a typing annotation) from ``to_plain``'s output."""
    where = where or getattr(cls, "__name__", str(cls))
    if dataclasses.is_dataclass(cls):
        if not isinstance(data, dict):
            raise TypeError(f"{where}: expected an object for {cls.__name__}, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise TypeError(f"{where}: unknown fields {unknown} for {cls.__name__}")
        return cls(**{k: from_plain(hints[k], v, f"{where}.{k}") for k, v in data.items()})
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return from_plain(options[0], data, where)
        if any(dataclasses.is_dataclass(a) or typing.get_origin(a) is not None for a in options):
            raise TypeError(f"{where}: a union of {options} cannot be rebuilt from JSON (which one was it?); "
                            "give the field one structured type")
        return data  # a union of scalars (``int | float``): JSON kept the type
    if origin in (list, tuple):
        if not isinstance(data, list):
            raise TypeError(f"{where}: expected a list, got {type(data).__name__}")
        if origin is tuple and args and args[-1] is not Ellipsis:  # a fixed-length tuple: a type per position
            if len(args) != len(data):
                raise TypeError(f"{where}: expected {len(args)} items, got {len(data)}")
            return tuple(from_plain(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
        item = args[0] if args else Any
        values = [from_plain(item, v, f"{where}[{i}]") for i, v in enumerate(data)]
        return tuple(values) if origin is tuple else values
    if origin is dict:
        value = args[1] if len(args) == 2 else Any
        return {k: from_plain(value, v, f"{where}.{k}") for k, v in data.items()}
    if cls is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    return data


def project(cls: type[T], source: Any, **given: Any) -> T:
    """An instance of the dataclass ``cls`` built from every field of the dataclass ``source`` that ``cls`` also has
    (each as ``cls`` types it: a list as a tuple), and ``given`` for the rest or instead: a runtime type that takes
    part of a config section (``RolloutLimits`` of ``[rollout]``) without copying it field by field."""
    hints = typing.get_type_hints(cls)
    wanted = {f.name for f in dataclasses.fields(cls) if f.init} - set(given)
    taken = {f.name: from_plain(hints[f.name], to_plain(getattr(source, f.name)), f"{type(source).__name__}.{f.name}")
             for f in dataclasses.fields(source) if f.name in wanted}
    return cls(**taken, **given)


def to_json(obj: Any) -> str:
    return json.dumps(to_plain(obj))


def from_json(cls: type[T], text: str) -> T:
    return from_plain(cls, json.loads(text))


class PlainData:
    """``to_dict`` / ``from_dict`` for a dataclass whose fields are plain data (see the module docstring)."""

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        return from_plain(cls, data)
