"""Turn-level credit for multi-turn episodes (MT-GRPO-style, after Zeng et al. 2025; turn returns).

An episode of ``K`` assistant turns gets one reward per turn (``Turn.reward``: tool feedback,
format, the final outcome on the last turn). Instead of one advantage for every token of the
episode, each turn gets the advantage of its own *return* (what it and the turns after it
earned), compared with the same turn of the other episodes in its group:

1. ``G[i,k] = sum_{k' >= k} gamma^(k'-k) * r[i,k']`` over episode ``i``'s real turns (the
   discount counts turns, not tokens);
2. for each group and turn index ``k``: ``A[i,k] = (G[i,k] - mean) / (std + eps)`` over the
   group's episodes that reached turn ``k`` (Bessel std, as ``grpo_advantages``;
   ``std_normalize=False`` only centres). Fewer than two episodes at a turn index leave it no
   baseline, and its advantage is 0;
3. ``broadcast_turn_advantages`` puts ``A[i,k]`` on every sampled token of turn ``k``.

With one turn per episode this is exactly ``grpo_advantages`` of the outcome rewards.

That definition (``turn_advantages``, the estimator ``turn_grpo``) is biased when the agent chooses how
many turns to take. The episodes that reach turn ``k`` are a subset chosen by the policy's own earlier
actions; the std of a cell includes the return it scores, and late cells shrink to one or two episodes
(advantage 0 or +-0.71 whatever the returns). In a group where stopping and continuing earn the same
expected return but with different spreads, it favours the low-variance choice: a biased gradient
where the true one is zero (``tests/test_turn_credit.py`` computes it exactly). Issue 52 asks for a
definition whose baseline does not depend on the action it scores; so does the verl RFC on
MT-GRPO-style normalisation that it cites.

``turn_loo_advantages`` (the estimator ``turn_loo``) is that definition:

1. the same returns ``G[i,k]``;
2. ``A[i,k] = G[i,k] - b[i,k]`` with ``b[i,k]`` the mean of ``G[j,k]`` over the *other* episodes
   ``j != i`` of the group that reached turn ``k`` (leave-one-out, Kool et al. 2019; RLOO);
3. where no other episode reached turn ``k``, ``b[i,k]`` is the episode-level leave-one-out
   baseline: the mean of the other episodes' whole returns ``G[j,0]``; a group of one gets 0.

``b[i,k]`` is a function of the other episodes only, which are sampled independently of episode
``i``; so it cannot depend on ``i``'s action at turn ``k`` (or any of ``i``'s actions), and
``E[(G - b) grad log pi(a_k)] = E[G grad log pi(a_k)]``: the gradient is unbiased whatever the
turn counts. Which baseline is used (turn cell or fallback) also depends on the others only. There
is deliberately no division by a std: a std over the cell includes ``G[i,k]`` itself, which is what
biases ``turn_advantages`` (the returns keep the environment's scale, as in Dr.GRPO and RLOO).
"""

from __future__ import annotations

import torch


def turn_returns(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted return of each real turn; 0 on padding turns.

    turn_rewards, turn_mask: [N,K]  ->  [N,K]
    """
    if turn_rewards.shape != turn_mask.shape or turn_rewards.dim() != 2:
        raise ValueError(f"turn_rewards {tuple(turn_rewards.shape)} and turn_mask {tuple(turn_mask.shape)} "
                         "must be equal [N, K] shapes")
    live = turn_mask.bool()
    rewards = turn_rewards.float()
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for k in reversed(range(rewards.shape[1])):
        running = torch.where(live[:, k], rewards[:, k] + gamma * running, running)
        out[:, k] = torch.where(live[:, k], running, 0.0)
    return out


def turn_advantages(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, group_ids: torch.Tensor, *,
                    gamma: float = 1.0, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised turn returns, per turn index (see the module docstring).

    turn_rewards, turn_mask: [N,K]; group_ids: [N]  ->  [N,K] (0 on padding turns)
    """
    if group_ids.dim() != 1 or group_ids.shape[0] != turn_rewards.shape[0]:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must be [N] with N = {turn_rewards.shape[0]}")
    returns = turn_returns(turn_rewards, turn_mask, gamma)
    live = turn_mask.bool()
    advantages = torch.zeros_like(returns)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        for k in range(returns.shape[1]):
            rows = members & live[:, k]
            if int(rows.sum()) < 2:
                continue
            g = returns[rows, k]
            centred = g - g.mean()
            advantages[rows, k] = centred / (g.std(unbiased=True) + eps) if std_normalize else centred
    return advantages


def turn_loo_advantages(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, group_ids: torch.Tensor, *,
                        gamma: float = 1.0) -> torch.Tensor:
    """Turn returns minus a leave-one-out baseline that never depends on the scored episode (module docstring).

    ``A[i,k] = G[i,k] - mean_{j in g, j != i, j reached k} G[j,k]``; where no other episode of ``i``'s group
    reached turn ``k``, ``A[i,k] = G[i,k] - mean_{j in g, j != i} G[j,0]``; a group of one gets 0.

    turn_rewards, turn_mask: [N,K]; group_ids: [N]  ->  [N,K] (0 on padding turns)
    """
    if group_ids.dim() != 1 or group_ids.shape[0] != turn_rewards.shape[0]:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must be [N] with N = {turn_rewards.shape[0]}")
    returns = turn_returns(turn_rewards, turn_mask, gamma)
    live = turn_mask.bool().to(returns.dtype)
    _, group = torch.unique(group_ids, return_inverse=True)
    members = torch.zeros(int(group.max()) + 1 if len(group) else 0, len(group), dtype=returns.dtype)
    members[group, torch.arange(len(group))] = 1.0  # [groups, N]
    # per (group, turn): the sum of the returns of the episodes that reached it, and their count
    others_sum = (members @ (returns * live))[group] - returns * live
    others_n = (members @ live)[group] - live
    episode_sum = (members @ (returns[:, :1] * live[:, :1]))[group] - returns[:, :1] * live[:, :1]
    episode_n = (members @ live[:, :1])[group] - live[:, :1]
    turn_baseline = others_sum / others_n.clamp(min=1.0)
    episode_baseline = (episode_sum / episode_n.clamp(min=1.0)).expand_as(returns)
    baseline = torch.where(others_n > 0, turn_baseline, episode_baseline)
    has_baseline = (others_n > 0) | (episode_n > 0)
    return torch.where(live.bool() & has_baseline, returns - baseline, 0.0)


def broadcast_turn_advantages(turn_adv: torch.Tensor, token_turns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token advantages: ``A[i, token_turns[i,t]]`` on sampled tokens, 0 elsewhere.

    turn_adv: [N,K]; token_turns: [N,T] (turn index of each token, -1 on the prompt); mask: [N,T]
    ->  [N,T]
    """
    if token_turns.shape != mask.shape or token_turns.shape[0] != turn_adv.shape[0]:
        raise ValueError(f"token_turns {tuple(token_turns.shape)}, mask {tuple(mask.shape)} and turn_adv "
                         f"{tuple(turn_adv.shape)} disagree")
    live = mask.bool()
    if bool((live & ((token_turns < 0) | (token_turns >= turn_adv.shape[1]))).any()):
        raise ValueError("a sampled token has a turn index outside [0, K): token_turns and turn_adv disagree")
    index = token_turns.clamp(0, turn_adv.shape[1] - 1).long()
    return torch.where(live, turn_adv.float().gather(1, index), 0.0)


def episode_turn_tensors(episodes) -> tuple[torch.Tensor, torch.Tensor]:
    """``(turn_rewards [N,K], turn_mask [N,K])`` from episodes' ``turns`` (K = the most turns)."""
    k = max((len(e.turns) for e in episodes), default=0) or 1
    rewards = torch.zeros(len(episodes), k)
    live = torch.zeros(len(episodes), k)
    for i, e in enumerate(episodes):
        for turn in e.turns:
            rewards[i, turn.index] = float(turn.reward)
            live[i, turn.index] = 1.0
    return rewards, live
