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
3. where no other episode of the group reached turn ``k`` (fewer than two did), ``b[i,k]`` is the mean of
   ``G[j,k]`` over the batch's episodes of *other task groups* that reached turn ``k``: still a return of the
   same turn index, from outside the episode and its match; where none did either, there is nothing to compare
   turn ``k`` with, and ``A[i,k] = 0``. A group of one is in this case at every turn.

``b[i,k]`` is a function of other episodes only: the other episodes of ``i``'s group, sampled independently of
``i``, and the episodes of other task groups (the fallback leaves out ``i``'s task group, whose other seats may have
played against ``i``). So it cannot depend on ``i``'s action at turn ``k`` (or any of ``i``'s actions), and
``E[(G - b) grad log pi(a_k)] = E[G grad log pi(a_k)]``: the gradient is unbiased whatever the turn counts and the
rewards. Which baseline is used (the group's cell, the other task groups, none) also depends on the others only.

What the expected advantage is: if the expected return from turn ``k`` is the same ``m_k`` whatever the number of
turns an episode goes on to take (no action changes the expected return), ``E[A[i,k] | i took L turns]`` is the
same for every ``L > k``; it is 0 where the returns ``b[i,k]`` averages have expected value ``m_k`` too: always in
the group's cell, and in the fallback when the other task groups are drawn like ``i``'s (``tests/test_turn_credit.py``
enumerates both exactly). A fallback to tasks with another expected return at turn ``k`` shifts that turn's
advantage by an amount that none of ``i``'s actions changes: variance, not bias. (An earlier fallback, the other
episodes' *whole* return ``G[j,0]``, was unbiased too, but compared a turn's return with the return of another turn:
with per-turn rewards it gave the third of three turns an expected advantage of -0.33 where no action changes the
return.)

There is deliberately no division by a std: a std over the cell includes ``G[i,k]`` itself, which is what
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
                        task_group_ids: torch.Tensor | None = None, gamma: float = 1.0) -> torch.Tensor:
    """Turn returns minus a baseline of the same turn that never depends on the scored episode (module docstring).

    ``A[i,k] = G[i,k] - b[i,k]`` on every turn ``k`` episode ``i`` reached, with ``b[i,k]``:

    - the mean of ``G[j,k]`` over the other episodes ``j != i`` of ``i``'s group that reached turn ``k``;
    - where none did (fewer than two episodes of the group reached ``k``), the mean of ``G[j,k]`` over the
      episodes of the batch's other task groups that reached turn ``k``;
    - where none of those did either, there is no return at turn ``k`` to compare with, and ``A[i,k] = 0``.

    ``task_group_ids`` says which episodes may have played each other: the seats of a match share a task group but
    not a group (one group per role), and a seat's return depends on the other seats' actions; so the fallback takes
    no episode of ``i``'s task group. None: every group is its own task group (single-agent episodes).

    turn_rewards, turn_mask: [N,K]; group_ids, task_group_ids: [N]  ->  [N,K] (0 on padding turns)
    """
    if group_ids.dim() != 1 or group_ids.shape[0] != turn_rewards.shape[0]:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must be [N] with N = {turn_rewards.shape[0]}")
    if task_group_ids is None:
        task_group_ids = group_ids
    if task_group_ids.shape != group_ids.shape:
        raise ValueError(f"task_group_ids {tuple(task_group_ids.shape)} must be [N] like group_ids "
                         f"{tuple(group_ids.shape)}")
    returns = turn_returns(turn_rewards, turn_mask, gamma)
    live = turn_mask.bool().to(returns.dtype)
    reached = returns * live
    # per turn: the sum and the count of the returns of the other episodes of i's group that reached it ...
    group_sum, group_n = _sum_by(group_ids, reached) - reached, _sum_by(group_ids, live) - live
    # ... and of the episodes of the other task groups
    outside_sum = reached.sum(0) - _sum_by(task_group_ids, reached)
    outside_n = live.sum(0) - _sum_by(task_group_ids, live)
    baseline = torch.where(group_n > 0, group_sum / group_n.clamp(min=1.0), outside_sum / outside_n.clamp(min=1.0))
    has_baseline = (group_n > 0) | (outside_n > 0)
    return torch.where(live.bool() & has_baseline, returns - baseline, 0.0)


def _sum_by(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Row ``i``: the sum of the rows ``j`` of ``x`` with ``ids[j] == ids[i]`` (``i`` included).

    ids: [N]; x: [N,K]  ->  [N,K]
    """
    _, index = torch.unique(ids, return_inverse=True)
    return torch.zeros_like(x).index_add_(0, index, x)[index]


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
