"""Credit between the seats of a multi-role match: how their rewards relate, and SPIRAL's role baselines.

- ``seat_rewards(rewards, seats, mode)``: one step's rewards per seat under ``roles.rewards``: ``env`` as the
  environment gives them, ``zero_sum`` each seat's minus the mean of all seats' (they sum to 0, and rewards that
  already do are unchanged), ``team`` the mean for every seat (cooperative). Both are linear, so applying them
  to each step gives the same totals as applying them to the match's totals.
- ``rae_advantages(rewards, roles, baselines, alpha)``: role-conditioned advantage estimation (SPIRAL, Liu et
  al. 2025, "SPIRAL: Self-Play on Zero-Sum Games Incentivizes Reasoning via Multi-Agent Multi-Turn RL"): one
  baseline per role, an exponential moving average of that role's returns, ``b_r <- alpha * b_r + (1 - alpha)
  * mean(R of role r in this batch)``, then ``A = R - b_r``. SPIRAL updates the baseline one trajectory at a
  time; here it takes one step per batch, so the result does not depend on the order of the batch.

Pure functions over plain numbers and tensors; the estimator that keeps the baselines between steps is
``ctxrl.algo.estimators.rae``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

REWARD_MODES = ("env", "zero_sum", "team")


def seat_rewards(rewards: Mapping[str, float], seats: Sequence[str], mode: str) -> dict[str, float]:
    """Every seat's reward of one step under ``mode`` (a seat missing from ``rewards`` earned 0)."""
    if mode not in REWARD_MODES:
        raise ValueError(f"reward mode must be one of {', '.join(REWARD_MODES)}, not {mode!r}")
    unknown = sorted(set(rewards) - set(seats))
    if unknown:
        raise ValueError(f"rewards for {unknown}, which are not seats of this match ({', '.join(seats)})")
    raw = {seat: float(rewards.get(seat, 0.0)) for seat in seats}
    if mode == "env" or not seats:
        return raw
    mean = sum(raw.values()) / len(seats)
    if mode == "team":
        return {seat: mean for seat in seats}
    return {seat: r - mean for seat, r in raw.items()}


def rae_advantages(rewards: torch.Tensor, roles: torch.Tensor, baselines: torch.Tensor, *,
                   alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SPIRAL's role-conditioned advantages and the updated baselines.

    rewards: [N] float; roles: [N] int in ``[0, R)``; baselines: [R] float  ->  (advantages [N], baselines [R]).
    Each advantage is ``R - b_role`` against the baseline *before* this step's returns move it (as SPIRAL does:
    an episode's own return never enters the baseline it is judged against), then each role's baseline becomes
    ``alpha * b + (1 - alpha) * mean(its returns)``. A role with no episode in the batch keeps its baseline.
    """
    if rewards.dim() != 1 or roles.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and roles {tuple(roles.shape)} must be equal [N] tensors")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    updated = baselines.clone().float()
    for r in torch.unique(roles).tolist():
        if not 0 <= r < len(updated):
            raise ValueError(f"role index {r} outside the {len(updated)} baselines")
        members = roles == r
        updated[r] = alpha * updated[r] + (1.0 - alpha) * rewards[members].float().mean()
    return rewards.float() - baselines.float()[roles], updated
