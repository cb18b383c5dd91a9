"""Context spaces: the parameters an environment's variants are drawn from, and the splits.

A task is drawn in two steps: a *context* (e.g. ``{"digits": 2, "ops": 1}``) from the
environment's ``ContextSpace``, then a concrete prompt from that context. Three splits
measure three kinds of generalisation:

- ``train`` and ``heldout`` share the context ranges ``[low, high]`` but never share a
  prompt: ``split_of`` assigns each prompt to one of them by a stable hash, and
  ``sample_tasks`` rejects prompts of the other split. Heldout success therefore measures
  generalisation to unseen instances of familiar variants.
- ``ood`` draws each parameter from ``[ood_low, ood_high]`` (parameters without an OOD range
  keep their train range): unseen *variants*, e.g. longer numbers.

Everything is reproducible from a seed with ``random.Random`` and ``hashlib`` (never Python's
salted ``hash()``), so a task set is the same on every machine and every run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ctxrl.types import SPLITS, Task

KINDS = ("int", "float", "choice")

Generate = Callable[[dict[str, Any], random.Random], "tuple[str, str, dict[str, Any]]"]
"""``generate(context, rng) -> (prompt, answer, data)``: one concrete problem for a context."""


class ContextError(ValueError):
    """A context (or context parameter definition) outside what the space allows."""


@dataclass(frozen=True)
class ContextParam:
    """One axis of variation of an environment.

    ``int`` and ``float`` params are drawn uniformly from ``[low, high]`` for train/heldout
    and from ``[ood_low, ood_high]`` for ood (bounds inclusive); without an OOD range, ood
    uses the train range. ``choice`` params draw from ``choices`` in every split.
    """

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    default: Any = None
    ood_low: float | None = None
    ood_high: float | None = None
    choices: tuple[Any, ...] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        where = f"context param {self.name!r}"
        if self.kind not in KINDS:
            raise ContextError(f"{where}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "choice":
            if not self.choices:
                raise ContextError(f"{where}: a 'choice' param needs a non-empty choices list")
            object.__setattr__(self, "choices", tuple(self.choices))
            if self.default is None:
                object.__setattr__(self, "default", self.choices[0])
            if self.default not in self.choices:
                raise ContextError(f"{where}: default {self.default!r} is not one of {self.choices}")
            return
        if self.low is None or self.high is None or self.low > self.high:
            raise ContextError(f"{where}: needs low <= high, got low={self.low}, high={self.high}")
        if (self.ood_low is None) != (self.ood_high is None):
            raise ContextError(f"{where}: give both ood_low and ood_high, or neither")
        if self.ood_low is not None and self.ood_low > self.ood_high:  # type: ignore[operator]
            raise ContextError(f"{where}: needs ood_low <= ood_high, got {self.ood_low} > {self.ood_high}")
        if self.default is None:
            object.__setattr__(self, "default", self.low)
        if not self.low <= self.default <= self.high:
            raise ContextError(f"{where}: default {self.default} is outside the train range [{self.low}, {self.high}]")

    def range(self, split: str) -> tuple[Any, Any]:
        """The inclusive ``(low, high)`` this param is drawn from in ``split``."""
        if split == "ood" and self.ood_low is not None:
            return self.ood_low, self.ood_high
        return self.low, self.high

    def sample(self, split: str, rng: random.Random) -> Any:
        if self.kind == "choice":
            return rng.choice(self.choices)  # type: ignore[arg-type]
        low, high = self.range(split)
        if self.kind == "int":
            return rng.randint(int(low), int(high))
        return rng.uniform(float(low), float(high))

    def contains(self, value: Any, split: str | None = None) -> bool:
        """Whether ``value`` is allowed in ``split`` (``None``: in any split)."""
        if self.kind == "choice":
            return value in self.choices  # type: ignore[operator]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not float(value).is_integer():
            return False
        splits = SPLITS if split is None else (split,)
        return any(lo <= value <= hi for lo, hi in (self.range(s) for s in splits))


class ContextSpace:
    """An ordered set of ``ContextParam`` s; draws and checks whole contexts."""

    def __init__(self, params: Sequence[ContextParam]) -> None:
        names = [p.name for p in params]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ContextError(f"context space has duplicate params: {duplicates}")
        self.params: list[ContextParam] = list(params)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def has_ood(self) -> bool:
        """Whether some param's OOD range reaches outside its train range."""
        return any(p.ood_low is not None and (p.ood_low < p.low or p.ood_high > p.high) for p in self.params)  # type: ignore[operator]

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def sample(self, split: str, rng: random.Random) -> dict[str, Any]:
        """One context for ``split``; params are drawn in order, so a seed fixes the result."""
        _check_split(split)
        return {p.name: p.sample(split, rng) for p in self.params}

    def validate(self, context: dict[str, Any], split: str | None = None) -> None:
        """Raise ``ContextError`` naming the param and its range if ``context`` is not allowed.

        With ``split``, values must lie in that split's ranges; without, in any split's.
        """
        if split is not None:
            _check_split(split)
        missing = [n for n in self.names if n not in context]
        unknown = [n for n in context if n not in self.names]
        if missing or unknown:
            raise ContextError(f"context {context} has missing params {missing} / unknown params {unknown}; "
                               f"expected exactly {self.names}")
        for p in self.params:
            value = context[p.name]
            if p.contains(value, split):
                continue
            if p.kind == "choice":
                raise ContextError(f"context param {p.name!r}={value!r} is not one of {p.choices}")
            splits = SPLITS if split is None else (split,)
            ranges = ", ".join(sorted({f"[{lo}, {hi}]" for lo, hi in (p.range(s) for s in splits)}))
            article = "an" if p.kind == "int" else "a"
            raise ContextError(f"context param {p.name!r}={value!r} must be {article} {p.kind} in {ranges}"
                               + (f" for split {split!r}" if split else ""))

    def is_ood(self, context: dict[str, Any]) -> bool:
        """Whether some value of ``context`` lies outside its param's train range."""
        return any(p.kind != "choice" and not p.contains(context.get(p.name), "train") for p in self.params)

    def narrowed(self, ranges: dict[str, tuple[float, float]]) -> ContextSpace:
        """This space with the train (and held-out) range of each named param replaced by ``ranges[name]``, which
        must lie inside it; OOD ranges are kept, so the OOD split still tests what training never saw. An unknown
        param, a ``choice`` param or a range outside the param's own is a ``ContextError`` naming it."""
        unknown = sorted(set(ranges) - set(self.names))
        if unknown:
            raise ContextError(f"context ranges name unknown params {unknown}; this environment's are {self.names}")
        params = []
        for p in self.params:
            if p.name not in ranges:
                params.append(p)
                continue
            low, high = ranges[p.name]
            if p.kind == "choice":
                raise ContextError(f"context param {p.name!r} is a choice of {list(p.choices)}, not a range")
            if not (p.low <= low <= high <= p.high):
                raise ContextError(f"context range {p.name}={low}-{high} must lie within its train range "
                                   f"[{p.low}, {p.high}] (low <= high)")
            ood_low, ood_high = p.range("ood")
            params.append(dataclasses.replace(p, low=low, high=high, default=min(max(p.default, low), high),
                                              ood_low=ood_low, ood_high=ood_high))
        return ContextSpace(params)

    def describe(self) -> list[dict[str, Any]]:
        """One plain dict per param, for tables and reports."""
        rows = []
        for p in self.params:
            row: dict[str, Any] = {"name": p.name, "kind": p.kind, "default": p.default, "description": p.description}
            if p.kind == "choice":
                row["choices"] = list(p.choices)  # type: ignore[arg-type]
            else:
                row["train"] = [p.low, p.high]
                row["ood"] = list(p.range("ood"))
            rows.append(row)
        return rows


def parse_ranges(text: str) -> dict[str, tuple[float, float]]:
    """``"pages=3-4,filler=0-6"`` as ``{"pages": (3, 4), "filler": (0, 6)}``; an empty text is no ranges. A
    malformed entry is a ``ContextError`` showing the form."""
    ranges: dict[str, tuple[float, float]] = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, sep, span = entry.partition("=")
        low, dash, high = span.strip().partition("-")
        try:
            values = (float(low), float(high if dash else low))
        except ValueError:
            values = None
        if not sep or not name.strip() or values is None or name.strip() in ranges:
            raise ContextError(f"context range {entry!r}: write NAME=LOW-HIGH (or NAME=VALUE), each name once, "
                               "comma-separated: pages=3-4,filler=0-6")
        ranges[name.strip()] = tuple(int(v) if v.is_integer() else v for v in values)  # type: ignore[assignment]
    return ranges


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ContextError(f"unknown split {split!r}; expected one of {SPLITS}")


def stable_hash(text: str) -> str:
    """A hex digest of ``text`` that is the same in every process (unlike ``hash()``)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def task_id(prefix: str, prompt: str, *, answer: str | None = None, data: dict[str, Any] | None = None) -> str:
    """A stable task id: ``prefix-`` plus 16 hex digits of a hash of the prompt, and of the answer and the hidden
    data when given. Two generated tasks can share a prompt and differ in what they hide (two ``fact_hunt`` trails
    from the same first page): their ids must differ, or an evaluation's per-task outcomes merge them."""
    text = prompt if answer is None and data is None else json.dumps([prompt, answer, data], sort_keys=True,
                                                                     default=str)
    digest = stable_hash(text)[:16]
    return f"{prefix}-{digest}" if prefix else digest


def split_of(key: str, heldout_fraction: float) -> str:
    """``"heldout"`` for a stable ``heldout_fraction`` of keys, ``"train"`` for the rest."""
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ContextError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    bucket = int(hashlib.sha256(("split:" + key).encode("utf-8")).hexdigest()[:16], 16) / 16**16
    return "heldout" if bucket < heldout_fraction else "train"


def sample_tasks(
    generate: Generate,
    space: ContextSpace,
    split: str,
    n: int,
    seed: int,
    *,
    heldout_fraction: float = 0.2,
    id_prefix: str = "",
    unique: bool = False,
    max_attempts: int | None = None,
) -> list[Task]:
    """Draw ``n`` tasks of ``split``, reproducibly from ``seed``.

    For train/heldout a prompt whose ``split_of`` is the other split is rejected and
    redrawn, so the two splits never share a prompt. One random stream is used per
    ``(seed, split)``, so the first ``k`` tasks of a draw of ``n > k`` equal a draw of ``k``.
    ``unique=True`` also rejects repeated prompts (useful for evaluation sets).
    """
    _check_split(split)
    if n < 0:
        raise ContextError(f"n must be >= 0, got {n}")
    if split == "heldout" and heldout_fraction <= 0.0:
        raise ContextError("heldout_fraction is 0, so no prompt can be heldout; raise it to sample that split")
    rng = random.Random(f"ctxrl:{seed}:{split}")
    budget = max_attempts if max_attempts is not None else 1000 * max(n, 1)
    tasks: list[Task] = []
    seen: set[str] = set()
    for _ in range(budget):
        if len(tasks) == n:
            break
        context = space.sample(split, rng)
        prompt, answer, data = generate(context, rng)
        if split != "ood" and split_of(prompt, heldout_fraction) != split:
            continue
        if unique and prompt in seen:
            continue
        seen.add(prompt)
        tasks.append(Task(id=task_id(id_prefix, prompt, answer=answer, data=data), prompt=prompt, answer=answer,
                          context=context, split=split, data=dict(data)))
    if len(tasks) < n:
        raise ContextError(f"drew only {len(tasks)} of {n} {split} tasks in {budget} attempts; the space is too "
                           "small for this split (lower n, drop unique=True, or widen the context ranges)")
    return tasks
