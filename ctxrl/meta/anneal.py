"""Annealed demonstrations: few-shot demos in training prompts, fading to none on a schedule.

Early in training a weak policy rarely succeeds, so a few solved examples in the prompt make
the first rewards reachable; the policy must end up solving tasks *without* them, because
evaluation is always zero-shot. A schedule therefore decays from ``start`` at step 0 to exactly
0 at ``steps`` and stays 0 afterwards. Two ways to fade:

- ``mode="count"``: every training episode at step ``t`` gets ``demo_count(t)`` demos;
- ``mode="probability"``: each training episode gets all ``max_demos`` demos with probability
  ``demo_probability(t)``, else none. Zero-shot prompts then appear from the first step, so the
  policy practises the evaluation condition all along.

Shapes (``f`` is the fraction still given, ``x = step / steps``): ``linear`` ``f = 1 - x``;
``cosine`` ``f = (1 + cos(pi x)) / 2``; ``step`` ``f = 1`` until ``steps``, then 0. Counts round
*up* (``ceil(start * f)``), so a count schedule keeps at least one demo until ``steps`` and is 0
exactly there.

Sampling is a pure function of ``(seed, step, episode_index)``: the same episode gets the same
demos in any process and in any order. Evaluation is the contract ``evaluation=True -> no
demos``; the keyword is required so that no caller forgets to choose. What a demonstration is
(rendered messages of a solved task, never the task being played) is the rollout's business.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ctxrl.settings import NON_NEGATIVE, POSITIVE

KINDS = ("linear", "cosine", "step")
MODES = ("count", "probability")


def _remaining_fraction(step: int, steps: int, kind: str) -> float:
    """``f(step)`` of the module docstring: 1 at step 0, exactly 0 at and after ``steps``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0 (the step at which demonstrations stop), got {steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step >= steps:
        return 0.0
    if kind == "step":
        return 1.0
    x = step / steps
    return 1.0 - x if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * x))


def demo_count(step: int, *, start: int, steps: int, kind: str = "linear") -> int:
    """Number of demonstrations at ``step``: ``ceil(start * f(step))``; ``start`` at 0, 0 from ``steps`` on.

    E.g. ``start=4, steps=10, linear``: steps 0-2 -> 4, 3-4 -> 3, 5-7 -> 2, 8-9 -> 1, 10+ -> 0.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0 demonstrations, got {start}")
    fraction = _remaining_fraction(step, steps, kind)
    if kind == "linear":  # exact integer arithmetic: no 2.0000000001 rounding up to 3
        return -(-start * (steps - step) // steps) if step < steps else 0
    return math.ceil(start * fraction - 1e-9)


def demo_probability(step: int, *, start: float = 1.0, steps: int, kind: str = "linear") -> float:
    """Probability that an episode gets demonstrations at ``step``: ``start * f(step)``, 0 from ``steps`` on."""
    if not 0.0 <= start <= 1.0:
        raise ValueError(f"start must be a probability in [0, 1], got {start}")
    return start * _remaining_fraction(step, steps, kind)


@dataclass(frozen=True)
class DemoSettings:
    """``[meta.demos]``: annealed demonstrations, few-shot solved examples in training prompts (the ``meta`` runner
    reads them from ``RolloutSpec.demos``)."""

    max: int = field(default=0, metadata=NON_NEGATIVE)
    """Annealed demonstrations: few-shot solved examples in training prompts (count at step 0, or per episode
    that gets them); evaluation never gets any. 0 = off."""
    steps: int = field(default=0, metadata=NON_NEGATIVE)
    """The RL step from which no training prompt gets demonstrations (the schedule reaches 0 there)."""
    kind: str = "linear"
    """Shape of the decay: ``linear``, ``cosine`` or ``step`` (constant, then none)."""
    mode: str = "count"
    """``count``: every episode gets the scheduled number; ``probability``: ``max`` or none, with the
    scheduled probability."""
    source: str = "solve"
    """Where demonstrations come from: ``solve`` (the env's scripted solutions of other training tasks) or a
    JSONL file of ``{"prompt", "messages"}`` lines."""
    pool: int = field(default=64, metadata=POSITIVE)
    """Training tasks solved for the ``solve`` pool (a task's own demo is never shown to it)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class DemoSchedule:
    """How many few-shot demonstrations a training episode's prompt gets; validated on construction."""

    max_demos: int = 0
    """Demonstrations at step 0 (``count``), or in an episode that gets them (``probability``). 0 turns demos off."""
    steps: int = 0
    """The training step from which no episode gets demonstrations (0 = never any)."""
    kind: str = "linear"
    """Shape of the decay: ``linear``, ``cosine`` or ``step`` (constant, then none)."""
    mode: str = "count"
    """``count``: every episode gets ``demo_count(step)``; ``probability``: all ``max_demos`` or none,
    with ``demo_probability(step)``."""

    def __post_init__(self) -> None:
        if self.max_demos < 0:
            raise ValueError(f"max_demos must be >= 0, got {self.max_demos}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0 (the step at which demonstrations stop), got {self.steps}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_spec(cls, settings: DemoSettings) -> DemoSchedule:
        """The schedule of a run's ``[meta.demos]``."""
        return cls(max_demos=settings.max, steps=settings.steps, kind=settings.kind, mode=settings.mode)


def _rng(seed: int, step: int, episode_index: int) -> random.Random:
    # A string seed goes through SHA-512: stable across processes and Python runs, unlike hash().
    return random.Random(f"ctxrl-demos:{seed}:{step}:{episode_index}")


def num_demos(schedule: DemoSchedule, *, step: int, seed: int, episode_index: int, evaluation: bool) -> int:
    """Demonstrations for one episode: 0 in evaluation, else as ``schedule`` says at ``step``."""
    if evaluation:
        return 0
    if schedule.mode == "count":
        return demo_count(step, start=schedule.max_demos, steps=schedule.steps, kind=schedule.kind)
    p = demo_probability(step, steps=schedule.steps, kind=schedule.kind)
    if p == 0.0:
        return 0
    return schedule.max_demos if _rng(seed, step, episode_index).random() < p else 0


def sample_demos(schedule: DemoSchedule, *, step: int, pool_size: int, seed: int, episode_index: int,
                 evaluation: bool) -> list[int]:
    """Indices into a pool of ``pool_size`` demonstrations for one episode (distinct; [] in evaluation).

    The pool must not hold the task being played (that would leak its answer); filter it first.
    """
    n = num_demos(schedule, step=step, seed=seed, episode_index=episode_index, evaluation=evaluation)
    if n == 0:
        return []
    if n > pool_size:
        raise ValueError(f"the schedule asks for {n} demonstrations at step {step} but the pool holds {pool_size}; "
                         "add demonstrations or lower max_demos")
    return _rng(seed + 1, step, episode_index).sample(range(pool_size), n)
