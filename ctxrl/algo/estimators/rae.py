"""``rae``: SPIRAL's role-conditioned advantage estimation, for self-play in multi-role environments.

Liu et al. 2025 (SPIRAL) keep one baseline per (game, role): an exponential moving average of that role's
returns, ``b_r <- alpha * b_r + (1 - alpha) * R``, and train on ``A = R - b_r``. With one environment per
run, the baselines here are per role (``Episode.role``; a single-agent run has one). What it keeps and
changes (``ctxrl.algo.roles.rae_advantages``): the baseline moves once per step, towards the mean return of
that role's episodes in the step (SPIRAL moves it after every trajectory; once per batch the result does not
depend on the order of the batch); baselines start at 0; the advantage is not normalised, and goes on every
sampled token of every segment (``broadcast``). It needs no groups (``rollout.group_size = 1`` works), and
its baselines are saved in checkpoints and restored on resume (``state_dict``). ``[algo.rae] alpha``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrl.algo.estimators.base import Estimator, SegmentBonus, broadcast, register_estimator
from ctxrl.algo.roles import rae_advantages
from ctxrl.settings import in_range
from ctxrl.types import Episode, TrainSequence


@dataclass(frozen=True)
class RAESettings:
    """``[algo.rae]``."""

    alpha: float = field(default=0.95, metadata=in_range(0.0, 1.0))
    """How much of its old value a role's baseline keeps each step (SPIRAL: 0.95)."""


@register_estimator
class RAE(Estimator):
    """One EMA baseline per role; ``A = R - b_role`` on every sampled token."""

    name = "rae"
    needs_groups = False
    one_per_episode = True
    Settings = RAESettings

    def __init__(self, *args, **kwargs) -> None:  # (the base's settings and options)
        super().__init__(*args, **kwargs)
        self.baselines: dict[str, float] = {}
        """Each role's baseline (absent: 0, never seen)."""

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None,
                 segment_bonus: SegmentBonus | None = None) -> list[list[TrainSequence]]:
        if token_rewards is not None:
            raise ValueError("the rae estimator takes no per-token rewards; put the KL in the loss "
                             "(algo.kl_placement=loss)")
        if not episodes:
            return []
        roles = sorted({e.role for e in episodes} | set(self.baselines))
        index = {role: i for i, role in enumerate(roles)}
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        which = torch.tensor([index[e.role] for e in episodes], dtype=torch.long)
        before = torch.tensor([self.baselines.get(role, 0.0) for role in roles], dtype=torch.float32)
        advantages, after = rae_advantages(rewards, which, before, alpha=self.options.alpha)
        self.baselines.update({role: float(after[index[role]]) for role in {e.role for e in episodes}})
        return [broadcast(e, a, segment_bonus) for e, a in zip(episodes, advantages.tolist())]

    def state_dict(self) -> dict:
        return {"baselines": dict(self.baselines)}

    def load_state_dict(self, state: dict) -> None:
        self.baselines = {str(k): float(v) for k, v in state.get("baselines", {}).items()}
