"""The context of ``reasoning_gym:`` environments: a family's variables, their ranges per split, a mix's space.

A family's context variables are its numeric curriculum attributes (``chain_sum``'s ``num_terms``, levels 2..12,
setting ``min_terms`` and ``max_terms``) and the configuration fields ``ranges`` names; ``family_spec`` reads them
under the settings of ``[env.reasoning_gym]`` (``ctxrl.envs.from_reasoning_gym.Settings``), checks every level
with the family's own configuration check, and gives each variable its train range (levels ``train_levels``) and
its ood range (levels ``ood_levels``, the train range left out). ``FamiliesSpace`` is the context space of one
family or a mix: ``family`` first, then that family's variables. docs/reasoning-gym.md says the rest.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

import tomllib

from ctxrl.envs.base import EnvError
from ctxrl.tasks.space import ContextParam, ContextSpace

RESERVED = ("seed", "size")
"""Configuration fields ctxrl sets itself (``ctxrl.envs.from_reasoning_gym``: each configuration's dataset is built
once, and a task is one of its entries, by index)."""


# -- a family's context variables ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variable:
    """A context variable of a family: which configuration fields its value sets."""

    param: ContextParam
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """One family's context variables and the configuration fields fixed for all its tasks."""

    name: str
    variables: tuple[Variable, ...]
    fixed: dict[str, Any]

    @property
    def space(self) -> ContextSpace:
        return ContextSpace([v.param for v in self.variables])

    def config(self, context: dict[str, Any]) -> dict[str, Any]:
        """The configuration fields a context sets (with the fixed ones)."""
        config = dict(self.fixed)
        for v in self.variables:
            for name in v.fields:
                config[name] = context[v.param.name]
        return config


def _entries(items: list[str], what: str, families: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """``[FAMILY.]NAME=VALUE`` entries by family (a bare NAME applies to every family): family -> NAME -> VALUE."""
    out: dict[str, dict[str, str]] = {f: {} for f in families}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise EnvError(f"[env.reasoning_gym] {what} entry {item!r} must look like [FAMILY.]NAME=VALUE")
        family, dot, name = key.rpartition(".")
        if dot and family not in families:
            raise EnvError(f"[env.reasoning_gym] {what} entry {item!r} names family {family!r}, which is not one of "
                           f"{', '.join(families)}")
        for f in ([family] if dot else families):
            out[f][name] = value
    return out


def _parse_range(text: str, where: str) -> tuple[float, float, tuple[float, float] | None]:
    """``LOW..HIGH[/OOD_LOW..OOD_HIGH]`` (or a single value) -> (low, high, ood range or None)."""
    def pair(part: str) -> tuple[float, float]:
        low, sep, high = part.partition("..")
        try:
            values = (float(low), float(high if sep else low))
        except ValueError:
            raise EnvError(f"[env.reasoning_gym] ranges: {where}={text!r} must be LOW..HIGH or "
                           "LOW..HIGH/OOD_LOW..OOD_HIGH (numbers)") from None
        if values[0] > values[1]:
            raise EnvError(f"[env.reasoning_gym] ranges: {where}={text!r} has LOW > HIGH")
        return values

    train, sep, ood = text.partition("/")
    return (*pair(train), pair(ood) if sep else None)


def _numeric_kind(values: list[Any]) -> str | None:
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "int"
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return "float"
    return None


def _level_values(levels: list[Any], span: list[int]) -> list[Any]:
    """The levels from ``span[0]`` to ``span[1]`` (inclusive; an index past the last level is the last)."""
    last = len(levels) - 1
    return levels[min(span[0], last):min(span[1], last) + 1]


def _checks(config_cls: type, config: dict[str, Any]) -> str | None:
    """Why the family's own configuration check refuses ``config`` (None: it accepts it)."""
    try:
        made = config_cls(**config)
        if hasattr(made, "validate"):
            made.validate()
    except (AssertionError, ValueError, TypeError) as exc:
        return str(exc) or type(exc).__name__
    return None


def _param(name: str, kind: str, train: tuple[float, float], ood: tuple[float, float] | None,
           description: str) -> ContextParam:
    """A context param whose ood range leaves out the train range (none when nothing is left)."""
    cast = int if kind == "int" else float
    low, high = cast(train[0]), cast(train[1])
    if ood is not None:
        ood_low, ood_high = cast(ood[0]), cast(ood[1])
        step = 1 if kind == "int" else 0
        if ood_low >= low and ood_low <= high:
            ood_low = high + step
        if ood_high <= high and ood_high >= low:
            ood_high = low - step
        inside = ood_low <= low and ood_high >= high  # around the train range: no one-sided ood
        ood = None if ood_low > ood_high or inside else (ood_low, ood_high)
    return ContextParam(name, kind, low=low, high=high, ood_low=ood[0] if ood else None,
                        ood_high=ood[1] if ood else None, description=description)


def _curriculum_variables(family: str, settings: Any, config_cls: type, base: dict[str, Any]) -> list[Variable]:
    """The variables of a family's curriculum: each numeric attribute, its levels checked by the family."""
    from reasoning_gym.coaching.attributes import RangeAttributeDefinition
    from reasoning_gym.factory import CURRICULA

    if family not in CURRICULA:
        return []
    variables = []
    for attr in CURRICULA[family]().attributes.values():
        kind = _numeric_kind(list(attr.levels))
        if kind is None:
            continue
        fields = ((attr.lower_field_name, attr.upper_field_name) if isinstance(attr, RangeAttributeDefinition)
                  else (attr.field_name,))
        good, dropped = [], []
        for level, value in enumerate(attr.levels):
            problem = _checks(config_cls, {**base, **{f: value for f in fields}})
            (dropped if problem else good).append((level, value, problem))
        if dropped:
            listed = ", ".join(f"{level} ({value})" for level, value, _ in dropped)
            warnings.warn(f"reasoning_gym:{family}: {attr.name} level(s) {listed} fail the family's own check "
                          f"({dropped[0][2]}); left out of its ranges", stacklevel=2)
        usable = [value for _, value, _ in good]
        train = _level_values(usable, settings.train_levels)
        ood = _level_values(usable, settings.ood_levels)
        if not train:
            raise EnvError(f"reasoning_gym:{family}: no level of {attr.name} passes the family's own check; give "
                           f"[env.reasoning_gym] ranges = [\"{family}.{attr.name}=LOW..HIGH\"]")
        span = (min(ood), max(ood)) if ood else None
        description = f"{attr.description or attr.name} (sets {' and '.join(fields)}; levels {attr.levels})"
        variables.append(Variable(_param(attr.name, kind, (min(train), max(train)), span, description), fields))
    return variables


def _explicit_variables(family: str, ranges: dict[str, str], config_cls: type,
                        variables: list[Variable]) -> list[Variable]:
    """``ranges`` entries: replacing an attribute's levels, or making a numeric configuration field a variable."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    by_name = {v.param.name: v for v in variables}
    set_by = {name: v.param.name for v in variables for name in v.fields}
    out = []
    for name, text in ranges.items():
        low, high, ood = _parse_range(text, f"{family}.{name}")
        if name in by_name:
            kind, fields, description = by_name[name].param.kind, by_name[name].fields, by_name[name].param.description
        elif name in set_by and set_by[name] != name:
            raise EnvError(f"[env.reasoning_gym] ranges: {family}.{name} is set by the curriculum attribute "
                           f"{set_by[name]!r}; give the range for {set_by[name]} instead")
        elif name in defaults and name not in RESERVED and _numeric_kind([defaults[name]]):
            kind, fields, description = _numeric_kind([defaults[name]]), (name,), f"configuration field {name}"
        else:
            numeric = sorted(n for n, d in defaults.items() if n not in RESERVED and _numeric_kind([d]))
            raise EnvError(f"[env.reasoning_gym] ranges: {family} has no curriculum attribute or numeric "
                           f"configuration field {name!r}; attributes: {', '.join(by_name) or 'none'}; numeric "
                           f"fields: {', '.join(numeric)}")
        if kind == "int" and not all(float(x).is_integer() for x in (low, high, *(ood or ()))):
            raise EnvError(f"[env.reasoning_gym] ranges: {family}.{name}={text!r} must be whole numbers")
        out.append(Variable(_param(name, kind, (low, high), ood, description), fields))
    return out


def _fixed(family: str, values: dict[str, str], config_cls: type) -> dict[str, Any]:
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_cls)} - set(RESERVED)
    fixed = {}
    for name, text in values.items():
        if name not in names:
            raise EnvError(f"[env.reasoning_gym] fixed: {family} has no configuration field {name!r}; its fields: "
                           f"{', '.join(sorted(names))}")
        try:
            fixed[name] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            fixed[name] = text
    return fixed


def family_spec(family: str, settings: Any, families: tuple[str, ...]) -> Family:
    """A family's context variables and fixed fields under ``settings`` (of a mix of ``families``), checked against
    the family's own check."""
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[family][1]
    fixed = _fixed(family, _entries(settings.fixed, "fixed", families)[family], config_cls)
    ranges = _entries(settings.ranges, "ranges", families)[family]
    levelled = _curriculum_variables(family, settings, config_cls, fixed)
    explicit = _explicit_variables(family, ranges, config_cls, levelled)
    replaced = {v.param.name for v in explicit}
    variables = tuple([v for v in levelled if v.param.name not in replaced] + explicit)
    clash = sorted(set(fixed) & {f for v in variables for f in v.fields})
    if clash:
        raise EnvError(f"[env.reasoning_gym] fixed sets {family}'s {', '.join(clash)}, which its context variables "
                       "set; give a one-value range instead (ranges = [\"NAME=V\"])")
    spec = Family(family, variables, fixed)
    for split in ("train", "ood"):
        for end in (0, 1):
            context = {v.param.name: v.param.range(split)[end] for v in variables}
            problem = _checks(config_cls, spec.config(context))
            if problem:
                raise EnvError(f"reasoning_gym:{family}: the {split} context {context} fails the family's own check "
                               f"({problem}); narrow it with [env.reasoning_gym] ranges or train_levels / ood_levels")
    return spec


# -- the space of a mix: a family, then that family's variables -------------------------------------------------------
class FamiliesSpace(ContextSpace):
    """``family`` (drawn by weight), then that family's own context variables; ood draws only families with an ood
    range."""

    def __init__(self, families: list[Family], weights: list[float]) -> None:
        super().__init__([ContextParam("family", "choice", choices=tuple(f.name for f in families),
                                       description="reasoning-gym task family")])
        self.families = {f.name: f.space for f in families}
        self.weights = dict(zip(self.families, weights))
        for name, space in self.families.items():
            if "family" in space.names:
                raise EnvError(f"reasoning_gym:{name} has a context variable named 'family', which ctxrl uses")

    @property
    def names(self) -> list[str]:
        return ["family", *dict.fromkeys(n for space in self.families.values() for n in space.names)]

    @property
    def has_ood(self) -> bool:
        return any(space.has_ood for space in self.families.values())

    def defaults(self) -> dict[str, Any]:
        first = next(iter(self.families))
        return {"family": first, **self.families[first].defaults()}

    def sample(self, split: str, rng: random.Random) -> dict[str, Any]:
        names = [n for n, s in self.families.items() if split != "ood" or s.has_ood or not self.has_ood]
        family = rng.choices(names, weights=[self.weights[n] for n in names])[0]
        return {"family": family, **self.families[family].sample(split, rng)}

    def validate(self, context: dict[str, Any], split: str | None = None) -> None:
        from ctxrl.tasks.space import ContextError

        family = context.get("family")
        if family not in self.families:
            raise ContextError(f"context {context} has family {family!r}, not one of {list(self.families)}")
        self.families[family].validate({k: v for k, v in context.items() if k != "family"}, split)

    def is_ood(self, context: dict[str, Any]) -> bool:
        space = self.families.get(context.get("family"))
        return space is not None and space.is_ood({k: v for k, v in context.items() if k != "family"})

    def describe(self) -> list[dict[str, Any]]:
        rows = super().describe()
        mixed = len(self.families) > 1
        for family, space in self.families.items():
            rows += [{**row, "name": f"{family}.{row['name']}" if mixed else row["name"]} for row in space.describe()]
        return rows
