"""Advantage estimators by name: episodes in, one advantage per token out.

This is the one place that turns recorded episodes into the tensors the pure functions of
``ctxrl.algo`` take, so the training loop only names an estimator (``algo.advantage``):

| name | what | token advantages |
|---|---|---|
| ``grpo`` | group-normalised outcome (Bessel std) | the episode's, on every sampled token |
| ``dr_grpo`` | group-centred outcome (Dr.GRPO) | the episode's, on every sampled token |
| ``rloo`` | leave-one-out baseline | the episode's, on every sampled token |
| ``reinforce_pp`` | discounted returns of turn rewards, whitened over the batch (REINFORCE++) | per token |
| ``turn_grpo`` | group-normalised turn returns (MT-GRPO) | per turn |
| ``gae`` | GAE over sampled tokens with a learned critic, whitened over the batch (PPO) | per token |

The outcome estimators use ``Episode.reward`` (the sum of its turn rewards). The turn and token
estimators use each ``Turn.reward``, placed on the last sampled token of that turn (the
end-of-turn token, or the last token of a cut-off turn).

``token_rewards`` (optional, one list per episode aligned with ``input_ids``) adds per-token
rewards on sampled tokens, e.g. a KL penalty placed in the reward: the token estimators take
them where they are; the outcome estimators sum them per episode and the turn estimator per
turn. ``grpo`` and ``turn_grpo`` centre these sums within the group but do not divide them by
the outcome's std (which would blow a small KL spread up to unit size in a group whose
outcomes all agree); ``dr_grpo`` and ``rloo`` treat them as part of the reward.
"""

from __future__ import annotations

import torch

from ctxrl.algo.advantages import grpo_advantages, rloo_advantages
from ctxrl.algo.returns import gae_advantages, masked_whiten, reinforce_pp_returns
from ctxrl.algo.turns import broadcast_turn_advantages, episode_turn_tensors, turn_advantages
from ctxrl.types import Episode

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "turn_grpo", "gae")


def _padded(episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss mask [N,T], turn index [N,T]) right-padded with 0 / -1."""
    width = max(len(e.input_ids) for e in episodes)
    mask = torch.zeros(len(episodes), width)
    turns = torch.full((len(episodes), width), -1, dtype=torch.long)
    for i, e in enumerate(episodes):
        mask[i, : len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.float32)
        turns[i, : len(e.turn_index)] = torch.tensor(e.turn_index, dtype=torch.long)
    return mask, turns


def token_turn_rewards(episodes: list[Episode], mask: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """[N,T] with each turn's reward on the last sampled token of that turn."""
    rewards = torch.zeros_like(mask)
    for i, e in enumerate(episodes):
        for turn in e.turns:
            positions = ((turns[i] == turn.index) & mask[i].bool()).nonzero()
            if len(positions):
                rewards[i, int(positions[-1])] += float(turn.reward)
    return rewards


def _rows(x: torch.Tensor, episodes: list[Episode]) -> list[list[float]]:
    return [x[i, : len(e.input_ids)].tolist() for i, e in enumerate(episodes)]


def _extra(episodes: list[Episode], token_rewards: list[list[float]] | None, mask: torch.Tensor) -> torch.Tensor:
    """[N,T] of the optional per-token rewards, on sampled tokens only."""
    extra = torch.zeros_like(mask)
    if token_rewards is not None:
        if len(token_rewards) != len(episodes):
            raise ValueError(f"{len(token_rewards)} token-reward lists for {len(episodes)} episodes")
        for i, (e, row) in enumerate(zip(episodes, token_rewards)):
            if len(row) != len(e.input_ids):
                raise ValueError(f"episode {i} has {len(e.input_ids)} tokens but {len(row)} token rewards")
            extra[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return extra * mask


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
    if level not in ("token", "turn"):
        raise ValueError(f"GAE level must be token or turn, not {level!r}")
    if not episodes:
        return [], [], None
    mask, turns = _padded(episodes)
    if len(values) != len(episodes):
        raise ValueError(f"{len(values)} value lists for {len(episodes)} episodes")
    v = torch.zeros_like(mask)
    for i, row in enumerate(values):
        if len(row) != len(episodes[i].input_ids):
            raise ValueError(f"episode {i} has {len(episodes[i].input_ids)} tokens but {len(row)} values")
        v[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    rewards = token_turn_rewards(episodes, mask, turns) + _extra(episodes, token_rewards, mask)
    if level == "token":
        advantages, returns = gae_advantages(rewards, v, mask, gamma, lam)
        return _rows(masked_whiten(advantages, mask), episodes), _rows(returns, episodes), None
    k_max = max(int(turns.max()) + 1, 1)
    turn_r, turn_v, turn_live = (torch.zeros(len(episodes), k_max) for _ in range(3))
    starts = torch.zeros_like(mask)
    for k in range(k_max):
        in_turn = (turns == k) & mask.bool()
        turn_r[:, k] = (rewards * in_turn).sum(1)
        has = in_turn.any(1)
        first = in_turn.float().argmax(1)
        rows = has.nonzero().squeeze(1)
        turn_live[rows, k] = 1.0
        turn_v[rows, k] = v[rows, first[rows]]
        starts[rows, first[rows]] = 1.0
    turn_adv, turn_ret = gae_advantages(turn_r, turn_v, turn_live, gamma, lam)
    advantages = broadcast_turn_advantages(turn_adv, turns, mask)
    returns = torch.zeros_like(mask)
    for k in range(k_max):
        at_start = starts.bool() & (turns == k)
        returns = torch.where(at_start, turn_ret[:, k:k + 1].expand_as(returns), returns)
    value_mask = [[int(x) for x in row] for row in _rows(starts, episodes)]
    return _rows(masked_whiten(advantages, mask), episodes), _rows(returns, episodes), value_mask


def episode_advantages(name: str, episodes: list[Episode], *, gamma: float = 1.0,
                       token_rewards: list[list[float]] | None = None) -> list[list[float]]:
    """Per-token advantages (one list per episode, ``len == len(input_ids)``, 0 off the loss mask).

    ``gae`` needs a critic: use ``gae_episode_advantages`` with its values.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {', '.join(ESTIMATORS)}")
    if name == "gae":
        raise ValueError("the gae estimator needs the critic's values: call gae_episode_advantages")
    if not episodes:
        return []
    mask, turns = _padded(episodes)
    extra = _extra(episodes, token_rewards, mask)
    groups = torch.tensor([e.group_id for e in episodes], dtype=torch.long)
    if name in ("grpo", "dr_grpo", "rloo"):
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        if name == "rloo":
            per_episode = rloo_advantages(rewards + extra.sum(1), groups)
        else:
            # the token rewards are centred but never std-normalised: in a group whose outcomes all
            # agree, a small KL spread must stay small, not be blown up to unit size
            per_episode = grpo_advantages(rewards, groups, std_normalize=name == "grpo") + \
                grpo_advantages(extra.sum(1), groups, std_normalize=False)
        tokens = per_episode.unsqueeze(1) * mask
    elif name == "reinforce_pp":
        returns = reinforce_pp_returns(token_turn_rewards(episodes, mask, turns) + extra, mask, gamma)
        tokens = masked_whiten(returns, mask)
    else:
        turn_rewards, turn_mask = episode_turn_tensors(episodes)
        turn_extra = torch.zeros_like(turn_rewards)
        for k in range(turn_rewards.shape[1]):
            turn_extra[:, k] = (extra * (turns == k)).sum(1)
        turn_adv = turn_advantages(turn_rewards, turn_mask, groups, gamma=gamma) + \
            turn_advantages(turn_extra, turn_mask, groups, gamma=gamma, std_normalize=False)
        tokens = broadcast_turn_advantages(turn_adv, turns, mask)
    return _rows(tokens, episodes)
