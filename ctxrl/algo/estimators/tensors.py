"""Episodes to the padded tensors the pure functions of ``ctxrl.algo`` take, and back to per-episode lists."""

from __future__ import annotations

import torch

from ctxrl.types import Episode


def padded(episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss mask [N,T], turn index [N,T]) right-padded with 0 / -1."""
    width = max(len(e.input_ids) for e in episodes)
    mask = torch.zeros(len(episodes), width)
    turns = torch.full((len(episodes), width), -1, dtype=torch.long)
    for i, e in enumerate(episodes):
        mask[i, : len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.float32)
        turns[i, : len(e.turn_index)] = torch.tensor(e.turn_index, dtype=torch.long)
    return mask, turns


def group_ids(episodes: list[Episode]) -> torch.Tensor:
    """[N] ids of the episodes' baseline groups: one per (task group, role) (``Episode.baseline_group``), so the
    seats of a multi-role match are compared within their role; a single-agent episode's is its task group."""
    index: dict[tuple[int, str], int] = {}
    return torch.tensor([index.setdefault(e.baseline_group, len(index)) for e in episodes], dtype=torch.long)


def task_group_ids(episodes: list[Episode]) -> torch.Tensor:
    """[N] ids of the episodes' task groups (``Episode.group_id``): the seats of one match share one, whatever their
    roles, so a statistic that must not depend on an episode's actions leaves out its task group."""
    index: dict[int, int] = {}
    return torch.tensor([index.setdefault(e.group_id, len(index)) for e in episodes], dtype=torch.long)


def token_turn_rewards(episodes: list[Episode], mask: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """[N,T] with each turn's reward on the last sampled token of that turn."""
    rewards = torch.zeros_like(mask)
    for i, e in enumerate(episodes):
        for turn in e.turns:
            positions = ((turns[i] == turn.index) & mask[i].bool()).nonzero()
            if len(positions):
                rewards[i, int(positions[-1])] += float(turn.reward)
    return rewards


def turn_sums(values: torch.Tensor, turns: torch.Tensor, num_turns: int) -> torch.Tensor:
    """[N,K]: the sum of per-token ``values`` over each turn's tokens (a per-token reward summed into its turn's).

    values, turns (turn index of each token, -1 on the prompt): [N,T]; num_turns: K  ->  [N,K]
    """
    out = torch.zeros(values.shape[0], num_turns, dtype=values.dtype)
    for k in range(num_turns):
        out[:, k] = (values * (turns == k)).sum(1)
    return out


def rows(x: torch.Tensor, episodes: list[Episode]) -> list[list[float]]:
    """Row ``i`` of ``x`` cut to episode ``i``'s length."""
    return [x[i, : len(e.input_ids)].tolist() for i, e in enumerate(episodes)]


def per_token(episodes: list[Episode], values: list[list[float]] | None, mask: torch.Tensor, what: str) -> torch.Tensor:
    """[N,T] of optional per-token lists (one per episode, aligned with ``input_ids``); zeros when None."""
    out = torch.zeros_like(mask)
    if values is not None:
        if len(values) != len(episodes):
            raise ValueError(f"{len(values)} {what} lists for {len(episodes)} episodes")
        for i, (e, row) in enumerate(zip(episodes, values)):
            if len(row) != len(e.input_ids):
                raise ValueError(f"episode {i} has {len(e.input_ids)} tokens but {len(row)} {what}")
            out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out
