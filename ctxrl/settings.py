"""A registered component's own settings: a dataclass it declares, read from its own table of the config.

An estimator, context manager or environment that has knobs of its own declares them as a dataclass in its
class attribute ``Settings`` (fields with defaults and docstrings, like the config's sections). Its table in
the configuration file is the section's name and its own::

    [algo]
    advantage = "clipped_grpo"

    [algo.clipped_grpo]      # read only by the estimator registered as "clipped_grpo"
    limit = 2.0

and on the command line ``algo.clipped_grpo.limit=2.0``. ``parse_settings`` builds the dataclass from the table:
types are checked as for the config's own fields, an unknown key is an error naming the valid ones, and a
``__post_init__`` that raises ``ValueError`` becomes a ``ConfigError`` naming the table. So a new knob of an
estimator is one file: the estimator's, with its ``Settings`` (docs/algorithms.md, "Writing an estimator").

The numbers of a section and of a component's settings are checked the same way (``check_number``): every float
must be finite in float32 (TOML reads ``nan`` and ``inf``; neither is ever a setting, unless the field's metadata
says ``ALLOWS_INF``), and a field may declare its range in its metadata (``POSITIVE``, ``NON_NEGATIVE``, ``in_range``).
A field that may change when a run resumes says so the same way (``RESUMABLE``), in a section or a component's
settings: a resumed run compares the others.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from typing import Any

from ctxrl.errors import ConfigError

# A field whose value may differ between a checkpoint and the run resuming it (``--resume``): it changes how long
# the run goes on, what it logs or evaluates, the warm start (already done), how the same maths is split into
# micro-batches, or where rollouts run; never what a step computes. A dataclass whose every field is so says
# ``resumable: ClassVar[bool] = True`` (``resumable``). A section's fields and a component's settings alike.
RESUMABLE = {"resumable": True}

# The values a numeric field may take, in its metadata where it is declared (``check_number`` checks them; NaN is
# never in range): > 0, >= 0, or an interval (low, high] or [low, high].
POSITIVE = {"range": (0, None, True)}
NON_NEGATIVE = {"range": (0, None, False)}
ALLOWS_INF = {"inf": True}
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a setting beyond it is infinite once the run computes with it (``train.lr=1e39``)."""
"""Metadata of a float field that may be ``inf`` (a limit that means "none"); without it ``inf`` is an error."""


def in_range(low: float, high: float, *, low_open: bool = False) -> dict[str, Any]:
    """Metadata of a field that must lie in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    return {"range": (low, high, low_open)}


INT64_MAX = 2**63 - 1
"""The largest whole number a setting may be: seeds and counts go to numpy and torch as 64-bit integers."""


def check_number(key: str, value: Any, metadata: Mapping[str, Any], default: Any = None) -> None:
    """A ``ConfigError`` naming ``key`` unless the number ``value`` (or each number of a list) is finite (``inf``
    too where ``metadata`` has ``ALLOWS_INF``) and in its declared range; ``default`` is offered as the fix."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_number(f"{key}[{i}]", item, metadata)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
        raise ConfigError(f"{key} = {str(value)[:12]}... ({len(str(value))} digits) is past what a setting can be "
                          f"(a whole number within ±{INT64_MAX:.2e}); write a smaller one")
    bounds = _bounds(*metadata["range"]) if "range" in metadata else ""
    finite = not isinstance(value, float) or (math.isfinite(value) and abs(value) <= FLOAT32_MAX)
    if not (finite or (math.isinf(value) and metadata.get("inf", False))):
        fix = f" (the default is {default!r})" if isinstance(default, (int, float)) else ""
        raise ConfigError(f"{key} must be {bounds + ' and ' if bounds else ''}finite, got {value!r}; nan, inf "
                          f"and numbers past float32's range (3.4e38, where the run computes) are not settings: "
                          f"write a number{fix}")
    if "range" in metadata:
        low, high, low_open = metadata["range"]
        above = low < value if low_open else low <= value  # (False for NaN, as is the upper bound)
        if not (above and (high is None or value <= high)):
            raise ConfigError(f"{key} must be {bounds}, got {value!r}")


def resumable(cls: type, f: dataclasses.Field) -> bool:
    """Whether field ``f`` of the dataclass ``cls`` (a section, a component's settings) may change on ``--resume``:
    its metadata says ``RESUMABLE``, or ``cls`` says every field may (``resumable: ClassVar[bool] = True``)."""
    return bool(getattr(cls, "resumable", False) or f.metadata.get("resumable", False))


def _bounds(low: float, high: float | None, low_open: bool) -> str:
    """``> 0``, ``>= 0``, ``in [0, 1]``: a range as the errors say it."""
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}]"


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """``value`` (read from TOML) as a field of type ``annotation`` (``str``, ``int``, ``float``, ``bool`` or a list
    of those), or a ``ConfigError`` naming ``key``; an int is accepted where a float is expected."""
    if typing.get_origin(annotation) is list:  # list[str], list[int]: a TOML array of those
        item = typing.get_args(annotation)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list of {item.__name__}s (a TOML array such as [1, 2]), got {value!r}")
        return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    expected = {"str": str, "int": int, "float": float, "bool": bool}[annotation if isinstance(annotation, str)
                                                                      else annotation.__name__]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if not isinstance(value, expected):
        raise ConfigError(f"{key} must be a {expected.__name__}, got {value!r} ({type(value).__name__})")
    return value


def nearest(name: str, options: list[str]) -> str:
    """"; did you mean X?" for the closest of ``options``, or the list of them."""
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid: {', '.join(sorted(options)) or 'none'}"


def parse_settings(cls: type, table: Mapping[str, Any], where: str) -> Any:
    """``cls`` (a dataclass) from ``table``; ``where`` names the table in errors (``algo.clipped_grpo``)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        if key not in fields:
            hint = nearest(f"{where}.{key}", [f"{where}.{n}" for n in fields])
            raise ConfigError(f"unknown config key {where}.{key}{hint}")
        kwargs[key] = coerce(f"{where}.{key}", value, hints[key])
        check_number(f"{where}.{key}", kwargs[key], fields[key].metadata, fields[key].default)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # the settings' own check (__post_init__)
        raise ConfigError(f"[{where}]: {exc}") from None


def settings_table(settings: Any) -> dict[str, Any]:
    """The fields of a settings dataclass as a table (what ``parse_settings`` reads back)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
