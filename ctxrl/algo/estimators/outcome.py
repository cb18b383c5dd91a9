"""Outcome estimators: one advantage per episode from its final reward, with group statistics over episodes.

| name | advantage of episode ``i`` in group ``g`` |
|---|---|
| ``grpo`` | ``(r_i - mean_g) / (std_g + eps)``, Bessel std (``grpo_advantages``; Shao et al. 2024) |
| ``dr_grpo`` | ``r_i - mean_g`` (Dr.GRPO, Liu et al. 2025) |
| ``rloo`` | ``r_i - mean_{g \\ i}`` (leave-one-out; Ahmadian et al. 2024) |

``r_i`` is ``Episode.reward`` (the sum of its turn rewards). Optional per-token rewards (a KL
penalty placed in the reward) are summed per episode: ``grpo`` and ``dr_grpo`` centre those sums
within the group but never divide them by the outcome's std (in a group whose outcomes all
agree, a small KL spread must stay small, not be blown up to unit size); ``rloo`` treats them as
part of the reward. The advantage goes on every sampled token of every segment of the episode
(``broadcast``), so these estimators work with every context manager.
"""

from __future__ import annotations

import torch

from ctxrl.algo.advantages import grpo_advantages, rloo_advantages
from ctxrl.algo.estimators.base import Estimator, SegmentBonus, broadcast, register_estimator
from ctxrl.algo.estimators.tensors import group_ids, padded, per_token
from ctxrl.types import Episode, TrainSequence


class OutcomeEstimator(Estimator):
    """One advantage per episode, broadcast to its segments; ``advantages`` is the estimator's maths."""

    one_per_episode = True
    accepts_token_rewards = True

    def advantages(self, rewards: torch.Tensor, extra: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """Per-episode advantages from rewards [N], summed per-token rewards [N] and group ids [N]."""
        raise NotImplementedError

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None,
                 segment_bonus: SegmentBonus | None = None) -> list[list[TrainSequence]]:
        if not episodes:
            return []
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        if token_rewards is not None:
            mask, _ = padded(episodes)
            extra = (per_token(episodes, token_rewards, mask, "token rewards") * mask).sum(1)
        else:
            extra = torch.zeros_like(rewards)
        scalars = self.advantages(rewards, extra, group_ids(episodes)).tolist()
        return [broadcast(e, a, segment_bonus) for e, a in zip(episodes, scalars)]


@register_estimator
class GRPO(OutcomeEstimator):
    """Group-normalised outcome (Bessel std)."""

    name = "grpo"

    def advantages(self, rewards: torch.Tensor, extra: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return grpo_advantages(rewards, groups) + grpo_advantages(extra, groups, std_normalize=False)


@register_estimator
class DrGRPO(OutcomeEstimator):
    """Group-centred outcome."""

    name = "dr_grpo"

    def advantages(self, rewards: torch.Tensor, extra: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return grpo_advantages(rewards, groups, std_normalize=False) + \
            grpo_advantages(extra, groups, std_normalize=False)


@register_estimator
class RLOO(OutcomeEstimator):
    """Leave-one-out baseline."""

    name = "rloo"

    def advantages(self, rewards: torch.Tensor, extra: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return rloo_advantages(rewards + extra, groups)
