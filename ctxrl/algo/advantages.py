"""Advantage estimators: pure functions over tensors.

Shapes: ``N`` episodes; ``group_ids[N]`` says which episodes answer the same task.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath").

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` where ``g`` is episode ``i``'s group and the
    std is Bessel-corrected (``unbiased=True``), as in the GRPO reference implementations
    (TRL, verl). ``std_normalize=False`` keeps only the centring (Dr.GRPO, Liu et al. 2025).
    A group of one episode gets advantage 0 (its std is undefined).

    rewards: [N] float; group_ids: [N] int  ->  [N] float
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D shapes")
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        group = rewards[members]
        if group.numel() < 2:
            continue
        centred = group - group.mean()
        advantages[members] = centred / (group.std(unbiased=True) + eps) if std_normalize else centred
    return advantages


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

    ``A_i = r_i - mean_{j in g, j != i}(r_j) = n / (n - 1) * (r_i - mean_g(r))`` for a group ``g``
    of ``n >= 2`` episodes; a group of one gets 0 (it has no baseline).

    rewards: [N] float; group_ids: [N] int  ->  [N] float
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D shapes")
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        n = int(members.sum())
        if n < 2:
            continue
        group = rewards[members]
        advantages[members] = (group - group.mean()) * (n / (n - 1))
    return advantages
