"""Curricula: which training tasks (and how long an episode may be) at each RL step.

- ``FixedCurriculum``: the environment's own ``train`` distribution, every step (the default).
- ``HorizonCurriculum``: the ScalingInter-RL idea (Xi et al. 2025): cap the number of turns early
  in training and widen the cap in stages, so the policy first learns short interactions well
  and then learns to use longer ones. The task distribution is the fixed one.
- ``SelfPacedCurriculum``: SPaCE-like (Eimer et al. 2021): prefer contexts where the current
  success rate is neither about 0 nor about 1, where a group's rewards differ and the policy
  gradient is informative. It keeps a success estimate per context (Beta(1, 1) prior), draws a
  pool of ``pool_factor x n`` candidate train tasks, and picks ``n`` of them with probability
  proportional to ``max(p (1 - p), floor)``. The floor keeps every context in play.

A curriculum sees only ``env_cls.sample_tasks`` and the episodes' ``task.context`` and
``success``, so it works for any environment.

Curricula are registered by name (``CURRICULA``; ``curriculum.kind`` picks one), and a curriculum with knobs of
its own declares them as a ``Settings`` dataclass, read from its table ``[curriculum.NAME]`` (``ctxrl.settings``):
``[curriculum.horizon]`` and ``[curriculum.self_paced]``. Adding one is a class with a ``name`` here or in another
module, decorated with ``@register_curriculum`` (or a ``ctxrl.curricula`` entry point).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from ctxrl.registry import Registry
from ctxrl.settings import POSITIVE, in_range, settings_table
from ctxrl.types import Episode, Task

CURRICULA: Registry[type] = Registry("curriculum", ("ctxrl.tasks.curriculum",), entry_point_group="ctxrl.curricula")
"""The curricula by name (``curriculum.kind``); the built-ins are this module's."""

C = TypeVar("C", bound=type)


def register_curriculum(cls: C) -> C:
    """Class decorator: make ``curriculum.kind = cls.name`` choose ``cls``."""
    return CURRICULA.register(cls.name, cls)


def curriculum_names() -> list[str]:
    return CURRICULA.names()


def get_curriculum(name: str) -> type:
    return CURRICULA.get(name)


class Curriculum(Protocol):
    def sample_tasks(self, env_cls: type, n: int, seed: int, step: int) -> list[Task]: ...

    def max_turns(self, step: int, limit: int) -> int: ...

    def update(self, episodes: list[Episode]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@register_curriculum
class FixedCurriculum:
    """The environment's train distribution, every step; the configured turn limit."""

    name: ClassVar[str] = "fixed"
    Settings: ClassVar[type | None] = None
    """A curriculum's own settings, a dataclass read from its table ``[curriculum.NAME]``; None: it has none."""

    @classmethod
    def configured(cls, settings: Any) -> FixedCurriculum:
        """The curriculum its ``Settings`` describe (``make_curriculum``)."""
        return cls()

    def sample_tasks(self, env_cls: type, n: int, seed: int, step: int) -> list[Task]:
        return env_cls.sample_tasks("train", n, seed)

    def max_turns(self, step: int, limit: int) -> int:
        return limit

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep to continue exactly (JSON values only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint has {sorted(state)}")


@dataclass(frozen=True)
class HorizonSettings:
    """``[curriculum.horizon]``."""

    start_turns: int = field(default=2, metadata=POSITIVE)
    """The turn cap at step 0 (it rises to ``env.max_turns``)."""
    warmup_steps: int = field(default=20, metadata=POSITIVE)
    """The step from which the full ``env.max_turns`` applies."""
    stages: int = field(default=3, metadata=POSITIVE)
    """How many times the cap is raised on the way."""


@register_curriculum
class HorizonCurriculum(FixedCurriculum):
    """Turn cap ``start_turns`` at step 0, raised in ``stages`` equal steps to the limit by ``warmup_steps``."""

    name = "horizon"
    Settings = HorizonSettings

    @classmethod
    def configured(cls, settings: HorizonSettings) -> HorizonCurriculum:
        return cls(**settings_table(settings))

    def __init__(self, start_turns: int, warmup_steps: int, stages: int = 3) -> None:
        if start_turns < 1 or warmup_steps < 1 or stages < 1:
            raise ValueError("horizon curriculum: start_turns, warmup_steps and stages must be >= 1")
        self.start_turns, self.warmup_steps, self.stages = start_turns, warmup_steps, stages

    def max_turns(self, step: int, limit: int) -> int:
        if step >= self.warmup_steps or self.start_turns >= limit:
            return limit
        stage = step * self.stages // self.warmup_steps  # 0 .. stages-1
        return min(limit, self.start_turns + round((limit - self.start_turns) * stage / self.stages))


def context_key(context: dict[str, Any]) -> str:
    return json.dumps(context, sort_keys=True)


@dataclass(frozen=True)
class SelfPacedSettings:
    """``[curriculum.self_paced]``."""

    pool: int = field(default=4, metadata=POSITIVE)
    """Candidate tasks drawn per task kept."""
    floor: float = field(default=0.02, metadata=in_range(0.0, 0.25, low_open=True))
    """The smallest sampling weight, so no context drops out entirely."""


@register_curriculum
class SelfPacedCurriculum(FixedCurriculum):
    """Prefer contexts of intermediate success (see the module docstring)."""

    name = "self_paced"
    Settings = SelfPacedSettings

    @classmethod
    def configured(cls, settings: SelfPacedSettings) -> SelfPacedCurriculum:
        return cls(settings.pool, settings.floor)

    def __init__(self, pool_factor: int = 4, floor: float = 0.02) -> None:
        if pool_factor < 1 or not 0.0 < floor <= 0.25:
            raise ValueError("self-paced curriculum: pool_factor must be >= 1 and floor in (0, 0.25]")
        self.pool_factor, self.floor = pool_factor, floor
        self.counts: dict[str, list[int]] = {}  # context -> [successes, trials]

    def success_rate(self, context: dict[str, Any]) -> float:
        s, t = self.counts.get(context_key(context), (0, 0))
        return (s + 1) / (t + 2)

    def weight(self, context: dict[str, Any]) -> float:
        p = self.success_rate(context)
        return max(p * (1.0 - p), self.floor)

    def sample_tasks(self, env_cls: type, n: int, seed: int, step: int) -> list[Task]:
        pool = env_cls.sample_tasks("train", n * self.pool_factor, seed)
        rng = random.Random(f"ctxrl-self-paced:{seed}:{step}")
        chosen: list[Task] = []
        weights = [self.weight(t.context) for t in pool]
        for _ in range(min(n, len(pool))):  # weighted sampling without replacement
            i = rng.choices(range(len(pool)), weights=weights)[0]
            chosen.append(pool.pop(i))
            weights.pop(i)
        return chosen

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        for e in episodes:
            counts = self.counts.setdefault(context_key(e.task.context), [0, 0])
            counts[0] += int(e.success)
            counts[1] += 1
        rates = [self.success_rate(json.loads(k)) for k in self.counts]
        return {"curriculum_contexts": float(len(self.counts)),
                "curriculum_mid_contexts": float(sum(0.2 <= p <= 0.8 for p in rates))}

    def state_dict(self) -> dict[str, Any]:
        return {"counts": {k: list(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {k: [int(v[0]), int(v[1])] for k, v in state.get("counts", {}).items()}


def make_curriculum(section: Any, options: Any = None) -> Curriculum:
    """The curriculum a ``[curriculum]`` section (``CurriculumConfig``) names, with its own settings ``options`` (its
    ``Settings``, from ``[curriculum.NAME]``: ``Config.settings_of("curriculum", kind)``; None: their defaults)."""
    cls = get_curriculum(section.kind)
    if cls.Settings is None:
        return cls.configured(None)
    return cls.configured(options if options is not None else cls.Settings())
