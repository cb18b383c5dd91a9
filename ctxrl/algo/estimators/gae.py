"""``gae``: PPO's generalised advantage estimation with a learned critic, whitened over the batch.

The trainer builds the critic (``ctxrl.learner.critic``) and passes its per-token ``values``.
Its settings are its table, ``[algo.gae]`` (``GAESettings``): ``lam``, ``level``, and the critic's
``vf_clip`` and ``critic_lr``, which the learner reads from this table for any estimator that ``needs_critic``;
``gamma`` is the shared ``algo.gamma``. ``level="token"``: every sampled token is a step. ``level="turn"``: every
assistant turn is a step; its value is the critic's value at the turn's first sampled token (the state the turn
starts from), GAE runs over turns (``gamma`` and ``lam`` per turn), each turn's advantage goes to
all its sampled tokens, and the critic is trained at the turn-start positions only (the returned
value mask). Rewards: each turn's reward on its last sampled token, plus optional per-token rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrl.algo.estimators.base import Estimator, SegmentBonus, register_estimator, unsegmented
from ctxrl.algo.estimators.tensors import padded, per_token, rows, token_turn_rewards
from ctxrl.algo.returns import gae_advantages, masked_whiten
from ctxrl.algo.turns import broadcast_turn_advantages
from ctxrl.settings import NON_NEGATIVE
from ctxrl.types import Episode, TrainSequence

LEVELS = ("token", "turn")


@dataclass(frozen=True)
class GAESettings:
    """``[algo.gae]``: GAE's own settings, and its critic's (read by the learner for any estimator with a critic)."""

    lam: float = field(default=1.0, metadata=NON_NEGATIVE)
    """GAE's lambda."""
    level: str = "token"
    """What a step is: ``token`` (every sampled token) or ``turn`` (every assistant turn; the critic's value is read
    at each turn's first sampled token and trained there only)."""
    vf_clip: float = field(default=0.2, metadata=NON_NEGATIVE)
    """Clip range of the critic's value loss."""
    critic_lr: float = field(default=1e-3, metadata=NON_NEGATIVE)
    """AdamW learning rate of the critic (its value head starts at zero)."""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}; got {self.level!r}")


@register_estimator
class GAE(Estimator):
    name = "gae"
    needs_groups = False
    needs_critic = True
    accepts_token_rewards = True
    Settings = GAESettings

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None,
                 segment_bonus: SegmentBonus | None = None) -> list[list[TrainSequence]]:
        if values is None:
            raise ValueError("the gae estimator needs the critic's values per token (values=...)")
        unsegmented(self.name, episodes)
        o = self.options
        advantages, returns, value_mask = gae_episode_advantages(episodes, values, gamma=self.settings.gamma,
                                                                 lam=o.lam, token_rewards=token_rewards, level=o.level)
        masks = value_mask if value_mask is not None else [None] * len(episodes)
        return [[TrainSequence.of(e, a, returns=r, old_values=v, value_mask=vm, group_id=e.group_id,
                                  policy_version=e.policy_version)]
                for e, a, r, v, vm in zip(episodes, advantages, returns, values, masks)]


def gae_episode_advantages(episodes: list[Episode], values: list[list[float]], *, gamma: float = 1.0,
                           lam: float = 1.0, token_rewards: list[list[float]] | None = None, level: str = "token"
                           ) -> tuple[list[list[float]], list[list[float]], list[list[int]] | None]:
    """GAE from the critic's ``values`` per token: (advantages whitened over the batch, returns, value mask).

    ``level="token"``: every sampled token is a step (the value mask is the loss mask, returned as
    None). ``level="turn"``: every assistant turn is a step; its value is the critic's value at
    the turn's first sampled token (the state the turn starts from), GAE runs over turns
    (``gamma`` and ``lam`` per turn), each turn's advantage goes to all its sampled tokens, and
    the critic is trained at the turn-start positions only (the returned value mask).
    """
    if level not in LEVELS:
        raise ValueError(f"GAE level must be token or turn, not {level!r}")
    if not episodes:
        return [], [], None
    mask, turns = padded(episodes)
    if len(values) != len(episodes):
        raise ValueError(f"{len(values)} value lists for {len(episodes)} episodes")
    v = torch.zeros_like(mask)
    for i, row in enumerate(values):
        if len(row) != len(episodes[i].input_ids):
            raise ValueError(f"episode {i} has {len(episodes[i].input_ids)} tokens but {len(row)} values")
        v[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    extra = per_token(episodes, token_rewards, mask, "token rewards") * mask
    rewards = token_turn_rewards(episodes, mask, turns) + extra
    if level == "token":
        advantages, returns = gae_advantages(rewards, v, mask, gamma, lam)
        return rows(masked_whiten(advantages, mask), episodes), rows(returns, episodes), None
    k_max = max(int(turns.max()) + 1, 1)
    turn_r, turn_v, turn_live = (torch.zeros(len(episodes), k_max) for _ in range(3))
    starts = torch.zeros_like(mask)
    for k in range(k_max):
        in_turn = (turns == k) & mask.bool()
        turn_r[:, k] = (rewards * in_turn).sum(1)
        has = in_turn.any(1)
        first = in_turn.float().argmax(1)
        live = has.nonzero().squeeze(1)
        turn_live[live, k] = 1.0
        turn_v[live, k] = v[live, first[live]]
        starts[live, first[live]] = 1.0
    turn_adv, turn_ret = gae_advantages(turn_r, turn_v, turn_live, gamma, lam)
    advantages = broadcast_turn_advantages(turn_adv, turns, mask)
    returns = torch.zeros_like(mask)
    for k in range(k_max):
        at_start = starts.bool() & (turns == k)
        returns = torch.where(at_start, turn_ret[:, k:k + 1].expand_as(returns), returns)
    value_mask = [[int(x) for x in row] for row in rows(starts, episodes)]
    return rows(masked_whiten(advantages, mask), episodes), rows(returns, episodes), value_mask
