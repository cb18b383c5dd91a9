"""Turn-level advantages: returns over turns, per-turn-index group normalisation, broadcast."""

from __future__ import annotations

import math

import pytest
import torch

from ctxrl.algo.advantages import grpo_advantages
from ctxrl.algo.turns import broadcast_turn_advantages, episode_turn_tensors, turn_advantages, turn_returns
from ctxrl.types import Episode, Task, Turn

REWARDS = torch.tensor([[0.0, 1.0], [0.5, 0.0], [1.0, 9.0]])  # 9.0 sits on a padding turn
LIVE = torch.tensor([[1, 1], [1, 1], [1, 0]])
GROUPS = torch.tensor([0, 0, 0])


def test_turn_returns_by_hand():
    torch.testing.assert_close(turn_returns(REWARDS, LIVE, 1.0), torch.tensor([[1.0, 1.0], [0.5, 0.0], [1.0, 0.0]]))
    torch.testing.assert_close(turn_returns(REWARDS, LIVE, 0.5), torch.tensor([[0.5, 1.0], [0.5, 0.0], [1.0, 0.0]]))


def test_turn_advantages_by_hand():
    adv = turn_advantages(REWARDS, LIVE, GROUPS, gamma=1.0, eps=0.0)
    s = 1 / math.sqrt(3)  # turn 0: returns [1, .5, 1], mean 5/6, Bessel std 0.288675
    # turn 1: only episodes 0 and 1 reached it: returns [1, 0] -> +-0.7071; episode 2 gets 0
    torch.testing.assert_close(adv, torch.tensor([[2 * s * 0.5, 1 / math.sqrt(2)], [-2 * s, -1 / math.sqrt(2)],
                                                  [2 * s * 0.5, 0.0]]), atol=1e-5, rtol=0)
    centred = turn_advantages(REWARDS, LIVE, GROUPS, gamma=0.5, std_normalize=False)
    # gamma 0.5: turn-0 returns [.5, .5, 1], mean 2/3
    torch.testing.assert_close(centred[:, 0], torch.tensor([-1 / 6, -1 / 6, 1 / 3]))


def test_lone_episode_at_a_turn_has_no_baseline():
    adv = turn_advantages(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]), torch.tensor([0, 0]))
    assert adv[0, 1] == 0.0 and adv[0, 0] > 0 > adv[1, 0]


@pytest.mark.parametrize("seed", range(3))
def test_single_turn_equals_grpo(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (12,), generator=g).float()
    groups = torch.arange(12) // 4
    adv = turn_advantages(rewards.unsqueeze(1), torch.ones(12, 1), groups)
    torch.testing.assert_close(adv[:, 0], grpo_advantages(rewards, groups))


def test_groups_are_separate():
    rewards = torch.tensor([[1.0], [0.0], [5.0], [3.0]])
    adv = turn_advantages(rewards, torch.ones(4, 1), torch.tensor([0, 0, 1, 1]), std_normalize=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 1.0, -1.0]))


def test_broadcast_to_sampled_tokens():
    turn_adv = torch.tensor([[0.3, -0.7]])
    token_turns = torch.tensor([[-1, -1, 0, 0, 0, 1, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1]])
    out = broadcast_turn_advantages(turn_adv, token_turns, mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.3, 0.3, 0.0, -0.7, -0.7]]))
    with pytest.raises(ValueError, match="turn index outside"):
        broadcast_turn_advantages(turn_adv, torch.tensor([[-1, -1, 0, 0, 0, 1, 2]]), mask)


def test_episode_turn_tensors():
    e1 = Episode(task=Task(id="a", prompt="", answer="", split="train"))
    e1.turns = [Turn(index=0, prompt_tokens=3, sampled_tokens=2, finish_reason="stop", text="", reward=0.25),
                Turn(index=1, prompt_tokens=9, sampled_tokens=2, finish_reason="stop", text="", reward=1.0)]
    e2 = Episode(task=Task(id="b", prompt="", answer="", split="train"))
    e2.turns = [Turn(index=0, prompt_tokens=3, sampled_tokens=2, finish_reason="stop", text="", reward=0.5)]
    rewards, live = episode_turn_tensors([e1, e2])
    torch.testing.assert_close(rewards, torch.tensor([[0.25, 1.0], [0.5, 0.0]]))
    torch.testing.assert_close(live, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))


def test_shape_errors():
    with pytest.raises(ValueError, match="must be equal"):
        turn_returns(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="group_ids"):
        turn_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
