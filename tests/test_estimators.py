"""Advantage estimators by name: episodes in, per-token advantages out (alignment and values)."""

from __future__ import annotations

import pytest
import torch

from ctxrl.algo.estimators import estimator_names, get_estimator, token_advantages
from ctxrl.algo.estimators.gae import gae_episode_advantages
from ctxrl.algo.estimators.tensors import padded, token_turn_rewards
from ctxrl.rollout.recorder import Recorder
from ctxrl.sections import AlgoConfig
from ctxrl.types import Episode, Task, Turn


def episode_advantages(name, episodes, *, gamma=1.0, token_rewards=None):
    """Per-token advantages of unsegmented episodes, by estimator name."""
    return token_advantages(name, episodes, AlgoConfig(gamma=gamma), token_rewards=token_rewards)


def _episode(group: int, turn_rewards: list[float], *, prompt: int = 3, sampled: int = 2, obs: int = 2) -> Episode:
    """prompt, then per turn: ``sampled`` policy tokens and (except after the last) ``obs`` tool tokens."""
    e = Episode(task=Task(id=f"t{group}", prompt="", answer=""), group_id=group)
    rec = Recorder(e)
    rec.write_ids([5] * prompt, sampled=False, turn=-1)
    for k, r in enumerate(turn_rewards):
        rec.write_ids([7] * sampled, sampled=True, turn=k, logprobs=[-0.5] * sampled)
        e.turns.append(Turn(index=k, prompt_tokens=0, sampled_tokens=sampled, finish_reason="stop", text="", reward=r))
        if k < len(turn_rewards) - 1:
            rec.write_ids([9] * obs, sampled=False, turn=k)
    e.reward = sum(turn_rewards)
    return e


EPISODES = [_episode(0, [0.0, 1.0]), _episode(0, [0.0]), _episode(1, [0.5, 0.5, 0.0]), _episode(1, [1.0])]


@pytest.mark.parametrize("name", [n for n in estimator_names()
                                  if not (get_estimator(n).needs_critic or get_estimator(n).needs_teacher)])
def test_alignment_and_mask(name):
    out = episode_advantages(name, EPISODES, gamma=0.9)
    assert len(out) == len(EPISODES)
    for adv, e in zip(out, EPISODES):
        assert len(adv) == len(e.input_ids)
        assert all(a == 0.0 for a, m in zip(adv, e.loss_mask) if not m)


def test_outcome_estimators_broadcast_the_episode_value():
    grpo = episode_advantages("grpo", EPISODES)
    # group 0 rewards [1, 0]: +-0.7071; group 1 rewards [1, 1]: 0
    assert grpo[0][3] == pytest.approx(0.70710, abs=1e-4) and grpo[1][3] == pytest.approx(-0.70710, abs=1e-4)
    assert set(grpo[0][i] for i, m in enumerate(EPISODES[0].loss_mask) if m) == {grpo[0][3]}
    assert all(a == 0 for a in grpo[2] + grpo[3])
    assert episode_advantages("dr_grpo", EPISODES)[0][3] == pytest.approx(0.5)
    assert episode_advantages("rloo", EPISODES)[0][3] == pytest.approx(1.0)


def test_turn_rewards_land_on_each_turns_last_sampled_token():
    mask, turns = padded(EPISODES[:1])
    rewards = token_turn_rewards(EPISODES[:1], mask, turns)
    # ids: 3 prompt | 2 sampled (turn 0) | 2 obs | 2 sampled (turn 1)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0.0, 0, 0, 0, 1.0]


def test_turn_grpo_credits_turns_separately():
    out = episode_advantages("turn_grpo", EPISODES)
    # group 1: turn-0 returns [1.0, 1.0] -> 0; only episode 2 has turns 1 and 2 -> no baseline -> 0
    assert all(a == 0 for a in out[2] + out[3])
    # group 0: turn-0 returns [1, 0] -> +-0.7071; turn 1 only in episode 0 -> 0
    sampled0 = [a for a, m in zip(out[0], EPISODES[0].loss_mask) if m]
    assert sampled0[:2] == pytest.approx([0.7071, 0.7071], abs=1e-4) and sampled0[2:] == [0.0, 0.0]


def test_reinforce_pp_is_whitened_returns():
    out = episode_advantages("reinforce_pp", EPISODES, gamma=1.0)
    sampled = torch.tensor([a for adv, e in zip(out, EPISODES) for a, m in zip(adv, e.loss_mask) if m])
    assert abs(float(sampled.mean())) < 1e-6 and float(sampled.std()) == pytest.approx(1.0, abs=1e-4)
    # within episode 2 (turn rewards 0.5, 0.5, 0): returns 1.0, 0.5, 0.0 -> strictly decreasing
    e2 = [a for a, m in zip(out[2], EPISODES[2].loss_mask) if m]
    assert e2[0] == e2[1] > e2[2] == e2[3] > e2[4] == e2[5]


def test_unknown_estimator_and_empty():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        episode_advantages("ppo", EPISODES)
    assert episode_advantages("grpo", []) == []


def test_gae_estimator_from_values():
    values = [[0.0] * len(e.input_ids) for e in EPISODES]
    adv, ret, value_mask = gae_episode_advantages(EPISODES, values, gamma=1.0, lam=1.0)
    assert value_mask is None  # token level: the critic trains on every sampled token
    # zero values: returns are the plain returns to go (episode 0: 1.0 on every sampled token)
    assert [r for r, m in zip(ret[0], EPISODES[0].loss_mask) if m] == [1.0, 1.0, 1.0, 1.0]
    assert all(a == 0.0 for a, m in zip(adv[0], EPISODES[0].loss_mask) if not m)
    sampled = torch.tensor([a for row, e in zip(adv, EPISODES) for a, m in zip(row, e.loss_mask) if m])
    assert abs(float(sampled.mean())) < 1e-6  # whitened over the batch
    with pytest.raises(ValueError, match="needs the critic"):
        episode_advantages("gae", EPISODES)
    with pytest.raises(ValueError, match="tokens but 2 values"):
        gae_episode_advantages(EPISODES[:1], [[0.0, 0.0]])


def test_token_rewards_reach_every_estimator():
    # a penalty of -0.1 on each sampled token
    penalties = [[-0.1 if m else 0.0 for m in e.loss_mask] for e in EPISODES]
    dr = episode_advantages("dr_grpo", EPISODES, token_rewards=penalties)
    # group 0: rewards 1 - 0.4 (4 sampled tokens) and 0 - 0.2 (2): centred +-0.4
    assert dr[0][3] == pytest.approx(0.4) and dr[1][3] == pytest.approx(-0.4)
    rpp = episode_advantages("reinforce_pp", EPISODES[:1], gamma=1.0, token_rewards=penalties[:1])
    # returns over episode 0's sampled tokens: 0.6, 0.7, 0.8 (then turn 1: -0.1+1 ... ) -> distinct, whitened
    sampled = [a for a, m in zip(rpp[0], EPISODES[0].loss_mask) if m]
    assert sampled[0] < sampled[1] < sampled[2] < sampled[3]
    turn = episode_advantages("turn_grpo", EPISODES, token_rewards=penalties, gamma=1.0)
    # group 0, turn 0: env returns [1, 0] -> +-0.7071 (std-normalised); penalty returns [-0.4, -0.2]
    # centred only -> -0.1 / +0.1
    assert turn[0][3] == pytest.approx(0.7071 - 0.1, abs=1e-4)
    assert turn[1][3] == pytest.approx(-0.7071 + 0.1, abs=1e-4)
    grpo = episode_advantages("grpo", EPISODES, token_rewards=penalties)
    assert grpo[0][3] == pytest.approx(0.7071 - 0.1, abs=1e-4)
    # group 1: outcomes agree (1, 1): only the centred penalty spread remains, unscaled
    # (episode 2 has 6 sampled tokens -> -0.6, episode 3 has 2 -> -0.2: mean -0.4)
    assert grpo[2][3] == pytest.approx(-0.2, abs=1e-5) and grpo[3][3] == pytest.approx(0.2, abs=1e-5)
    with pytest.raises(ValueError, match="tokens but 1 token rewards"):
        episode_advantages("grpo", EPISODES[:1], token_rewards=[[0.0]])


def test_turn_level_gae_by_hand():
    e = EPISODES[0]  # 3 prompt | 2 sampled (turn 0) | 2 obs | 2 sampled (turn 1); turn rewards 0, 1
    values = [[0.1 * p for p in range(len(e.input_ids))]]
    adv, ret, value_mask = gae_episode_advantages([e], values, gamma=1.0, lam=1.0, level="turn")
    # turn values are read at each turn's first sampled token: V0 = 0.3 (pos 3), V1 = 0.7 (pos 7)
    assert value_mask == [[0, 0, 0, 1, 0, 0, 0, 1, 0]]
    # A1 = 1 - 0.7 = 0.3; A0 = (0 + 0.7 - 0.3) + 0.3 = 0.7; returns A + V = 1.0 at both turn starts
    assert ret[0] == pytest.approx([0, 0, 0, 1.0, 0, 0, 0, 1.0, 0])
    sampled = [a for a, m in zip(adv[0], e.loss_mask) if m]  # whitened [0.7, 0.7, 0.3, 0.3]
    assert sampled[0] == sampled[1] == pytest.approx(0.866, abs=1e-3)
    assert sampled[2] == sampled[3] == pytest.approx(-0.866, abs=1e-3)
    with pytest.raises(ValueError, match="token or turn"):
        gae_episode_advantages([e], values, level="episode")
