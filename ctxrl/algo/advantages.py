"""Advantage estimators: pure functions over tensors.

Shapes: ``N`` episodes; ``group_ids[N]`` says which episodes answer the same task.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _per_group(rewards: torch.Tensor, group_ids: torch.Tensor,
               fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply ``fn`` to the rewards of each group of two or more episodes; singletons get 0."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal "
                         "1-D shapes")
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        if int(members.sum()) >= 2:
            advantages[members] = fn(rewards[members])
    return advantages


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath").

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` where ``g`` is episode ``i``'s group and the
    std is Bessel-corrected (``unbiased=True``), as in the GRPO reference implementations
    (TRL, verl). ``std_normalize=False`` keeps only the centring (Dr.GRPO, Liu et al. 2025).
    A group of one episode gets advantage 0 (its std is undefined).

    rewards: [N] float; group_ids: [N] int  ->  [N] float
    """
    def normalise(group: torch.Tensor) -> torch.Tensor:
        centred = group - group.mean()
        return centred / (group.std(unbiased=True) + eps) if std_normalize else centred

    return _per_group(rewards, group_ids, normalise)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

    ``A_i = r_i - mean_{j in g, j != i}(r_j) = n / (n - 1) * (r_i - mean_g(r))`` for a group ``g``
    of ``n >= 2`` episodes; a group of one gets 0 (it has no baseline).

    rewards: [N] float; group_ids: [N] int  ->  [N] float
    """
    return _per_group(rewards, group_ids, lambda group: (group - group.mean()) * (len(group) / (len(group) - 1)))
