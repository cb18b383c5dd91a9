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
"""

from __future__ import annotations

import json
import random
from typing import Any, Protocol

from ctxrl.types import Episode, Task


class Curriculum(Protocol):
    def sample_tasks(self, env_cls: type, n: int, seed: int, step: int) -> list[Task]: ...

    def max_turns(self, step: int, limit: int) -> int: ...

    def update(self, episodes: list[Episode]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedCurriculum:
    """The environment's train distribution, every step; the configured turn limit."""

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


class HorizonCurriculum(FixedCurriculum):
    """Turn cap ``start_turns`` at step 0, raised in ``stages`` equal steps to the limit by ``warmup_steps``."""

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


class SelfPacedCurriculum(FixedCurriculum):
    """Prefer contexts of intermediate success (see the module docstring)."""

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


KINDS = ("fixed", "horizon", "self_paced")


def make_curriculum(settings: Any) -> Curriculum:
    """The curriculum a ``[curriculum]`` config section (``CurriculumConfig``) describes."""
    s = settings
    if s.kind == "fixed":
        return FixedCurriculum()
    if s.kind == "horizon":
        return HorizonCurriculum(s.horizon_start_turns, s.horizon_warmup_steps, s.horizon_stages)
    if s.kind == "self_paced":
        return SelfPacedCurriculum(s.self_paced_pool, s.self_paced_floor)
    raise ValueError(f"unknown curriculum {s.kind!r}; choose one of {', '.join(KINDS)}")
