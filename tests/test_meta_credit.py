"""Credit across attempts: cross-episode returns, per-attempt-index group advantages, early stops,
MR-Search relative advantages and reflection credit, against hand-derived values."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ctxrl.algo.advantages import grpo_advantages
from ctxrl.algo.credit import (
    cross_episode_advantages,
    cross_episode_returns,
    reflection_advantages,
    relative_attempt_advantages,
    trial_advantages,
)
from ctxrl.algo.turns import turn_advantages


def close(actual, expected, tol=1e-6):
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected):
        if isinstance(e, list):
            close(a, e, tol)
        else:
            assert abs(a - e) <= tol, (actual, expected)


# -- cross-episode returns ------------------------------------------------------------------------


def test_cross_episode_returns_by_hand():
    # G2 = 1; G1 = 0 + 0.5 * 1; G0 = 0 + 0.5 * 0.5
    close(cross_episode_returns([0, 0, 1], 0.5), [0.25, 0.5, 1.0])
    # partial rewards: G2 = 0.2; G1 = 0.4 + 0.9 * 0.2 = 0.58; G0 = 1 + 0.9 * 0.58 = 1.522
    close(cross_episode_returns([1.0, 0.4, 0.2], 0.9), [1.522, 0.58, 0.2])
    close(cross_episode_returns([0, 1, 1], 1.0), [2.0, 2.0, 1.0])  # gamma 1: plain suffix sums
    close(cross_episode_returns([0.3, 0.7], 0.0), [0.3, 0.7])  # gamma 0: each attempt alone
    assert cross_episode_returns([], 0.5) == []


def test_early_stop_return_is_discounted_time_to_solve():
    # trials stop at their first success: G0 = gamma ** (index of the success), 0 if never solved
    for gamma in (0.3, 0.5, 1.0):
        assert cross_episode_returns([1], gamma)[0] == 1.0
        assert cross_episode_returns([0, 1], gamma)[0] == pytest.approx(gamma)
        assert cross_episode_returns([0, 0, 1], gamma)[0] == pytest.approx(gamma ** 2)
        assert cross_episode_returns([0, 0, 0], gamma)[0] == 0.0


@pytest.mark.parametrize("gamma", [-0.1, 1.5, float("nan")])
def test_gamma_outside_unit_interval_raises(gamma):
    with pytest.raises(ValueError, match=r"gamma_trial must be in \[0, 1\]"):
        cross_episode_returns([0, 1], gamma)
    with pytest.raises(ValueError, match="gamma_trial"):
        cross_episode_advantages([[0, 1], [1]], gamma_trial=gamma)
    with pytest.raises(ValueError, match="gamma_trial"):
        relative_attempt_advantages([[0, 1], [1]], gamma_trial=gamma)


# -- group advantages over trials (LaMer) ---------------------------------------------------------


def test_trial_advantages_full_group_by_hand():
    # G = 3 trials, K = 2 attempts, no early stop, returns given directly
    returns = [[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]
    adv = trial_advantages(returns, eps=0.0)
    # index 0: [1, 0, 2], mean 1, Bessel std sqrt((0 + 1 + 1) / 2) = 1 -> [0, -1, 1]
    # index 1: [0, 1, 2], mean 1, std 1 -> [-1, 0, 1]
    close(adv, [[0.0, -1.0], [-1.0, 0.0], [1.0, 1.0]])
    close(trial_advantages(returns, normalize="none"), [[0.0, -1.0], [-1.0, 0.0], [1.0, 1.0]])
    # scale the returns by 3: centred only scales by 3, normalised does not move
    tripled = [[3 * g for g in row] for row in returns]
    close(trial_advantages(tripled, normalize="none"), [[0.0, -3.0], [-3.0, 0.0], [3.0, 3.0]])
    close(trial_advantages(tripled, eps=0.0), adv)


def test_early_stopped_trials_leave_later_indices():
    # K = 3, gamma 0.5, rewards 0/1, trials stop at their first success:
    #   trial 0 solves at attempt 0: [1]        -> returns [1]
    #   trial 1 solves at attempt 1: [0, 1]     -> returns [0.5, 1]
    #   trial 2 solves at attempt 2: [0, 0, 1]  -> returns [0.25, 0.5, 1]
    #   trial 3 never solves:        [0, 0, 0]  -> returns [0, 0, 0]
    rewards = [[1], [0, 1], [0, 0, 1], [0, 0, 0]]
    adv = cross_episode_advantages(rewards, gamma_trial=0.5, normalize="none", num_attempts=3)
    # index 0 over all four: [1, .5, .25, 0], mean 0.4375
    # index 1 over trials 1-3 (trial 0 has stopped): [1, .5, 0], mean 0.5
    # index 2 over trials 2-3: [1, 0], mean 0.5
    close(adv, [[0.5625], [0.0625, 0.5], [-0.1875, 0.0, 0.5], [-0.4375, -0.5, -0.5]])
    # with the std: index 2 has std sqrt(0.5) -> +-0.5 / 0.70711
    normed = cross_episode_advantages(rewards, gamma_trial=0.5, eps=0.0)
    s0 = math.sqrt((0.5625 ** 2 + 0.0625 ** 2 + 0.1875 ** 2 + 0.4375 ** 2) / 3)
    close(normed[0], [0.5625 / s0])
    close(normed[2], [-0.1875 / s0, 0.0, 1 / math.sqrt(2)])
    close(normed[3], [-0.4375 / s0, -1.0, -1 / math.sqrt(2)])  # index 1: [1, .5, 0], std 0.5


def test_lone_trial_at_an_index_gets_zero():
    # only trial 1 reached attempt 1: no baseline there
    adv = cross_episode_advantages([[1.0], [0.0, 1.0]], gamma_trial=1.0, normalize="none")
    # index 0 returns [1, 1] -> both 0; index 1: lone -> 0
    close(adv, [[0.0], [0.0, 0.0]])
    assert trial_advantages([[3.0, 1.0]]) == [[0.0, 0.0]]  # a group of one trial


def test_one_attempt_per_trial_equals_grpo():
    rng = random.Random(0)
    for _ in range(5):
        rewards = [float(rng.random() < 0.5) for _ in range(6)]
        ours = cross_episode_advantages([[r] for r in rewards], gamma_trial=0.7)
        ref = grpo_advantages(torch.tensor(rewards), torch.zeros(6, dtype=torch.long))
        close([row[0] for row in ours], ref.tolist(), tol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_equals_turn_advantages_with_attempts_as_turns(seed):
    rng = random.Random(seed)
    k, g, gamma = 4, 5, 0.6
    rewards = [[rng.choice([0.0, 0.5, 1.0]) for _ in range(rng.randint(1, k))] for _ in range(g)]
    ours = cross_episode_advantages(rewards, gamma_trial=gamma)
    dense = torch.zeros(g, k)
    live = torch.zeros(g, k)
    for i, row in enumerate(rewards):
        dense[i, :len(row)] = torch.tensor(row)
        live[i, :len(row)] = 1
    ref = turn_advantages(dense, live, torch.zeros(g, dtype=torch.long), gamma=gamma)
    for i, row in enumerate(ours):
        close(row, ref[i, :len(row)].tolist(), tol=1e-5)


def test_groups_are_statistics_over_trials_not_attempts():
    # one trial's own attempts never act as each other's baseline: a lone trial gets all zeros
    # however different its attempts are, and adding a constant to attempt index 1 of every
    # trial (with gamma 0) leaves index 1's advantages unchanged
    assert cross_episode_advantages([[0.0, 5.0, -3.0]], gamma_trial=0.5) == [[0.0, 0.0, 0.0]]
    base = [[0.0, 1.0], [1.0, 0.0], [0.0, 0.5]]
    shifted = [[r0, r1 + 10.0] for r0, r1 in base]
    close(cross_episode_advantages(base, gamma_trial=0.0), cross_episode_advantages(shifted, gamma_trial=0.0))


def test_bad_groups_raise_with_the_fix():
    with pytest.raises(ValueError, match="has no attempts"):
        trial_advantages([[1.0], []])
    with pytest.raises(ValueError, match="num_attempts=2"):
        cross_episode_advantages([[0, 0, 1], [1]], gamma_trial=0.5, num_attempts=2)
    with pytest.raises(ValueError, match="num_attempts must be >= 1"):
        trial_advantages([[1.0]], num_attempts=0)
    with pytest.raises(ValueError, match="non-finite"):
        cross_episode_advantages([[0.0, float("nan")], [1.0]], gamma_trial=0.5)
    with pytest.raises(ValueError, match="normalize must be one of"):
        trial_advantages([[1.0], [0.0]], normalize="max")
    with pytest.raises(ValueError, match="baseline must be one of"):
        relative_attempt_advantages([[1.0], [0.0]], gamma_trial=1.0, baseline="median")
    assert trial_advantages([]) == []


# -- MR-Search relative advantages ----------------------------------------------------------------


def test_relative_advantages_by_hand_with_early_stop():
    rewards = [[1], [0, 1], [0, 0, 1], [0, 0, 0]]
    adv = relative_attempt_advantages(rewards, gamma_trial=0.5, baseline="loo")
    # index 0, all four: r = [1, 0, 0, 0]; LOO means [0, 1/3, 1/3, 1/3] -> D = [1, -1/3, -1/3, -1/3]
    # index 1, trials 1-3: r = [1, 0, 0]; LOO means [0, .5, .5] -> D = [1, -.5, -.5]
    # index 2, trials 2-3: r = [1, 0]; LOO means [0, 1] -> D = [1, -1]
    # A = D + 0.5 * A(next):
    #   trial 0: [1]
    #   trial 1: [-1/3 + .5 * 1, 1] = [1/6, 1]
    #   trial 2: [-1/3 + .5 * (-.5 + .5 * 1), -.5 + .5 * 1, 1] = [-1/3, 0, 1]
    #   trial 3: [-1/3 + .5 * (-.5 + .5 * -1), -.5 + .5 * -1, -1] = [-5/6, -1, -1]
    close(adv, [[1.0], [1 / 6, 1.0], [-1 / 3, 0.0, 1.0], [-5 / 6, -1.0, -1.0]])
    mean = relative_attempt_advantages(rewards, gamma_trial=0.5, baseline="mean")
    # D index 0: [.75, -.25, -.25, -.25]; index 1: [2/3, -1/3, -1/3]; index 2: [.5, -.5]
    close(mean, [[0.75], [-0.25 + 0.5 * 2 / 3, 2 / 3], [-0.25 + 0.5 * (-1 / 3 + 0.25), -1 / 3 + 0.25, 0.5],
                 [-0.25 + 0.5 * (-1 / 3 - 0.25), -1 / 3 - 0.25, -0.5]])


@pytest.mark.parametrize("seed", range(3))
def test_relative_equals_centred_cross_episode_without_early_stop(seed):
    # all trials play all K attempts: sum_k' gamma^(k'-k) (r - mean) = G - mean(G); LOO is n / (n-1) of it
    rng = random.Random(seed)
    g, k, gamma = 4, 3, 0.8
    rewards = [[rng.random() for _ in range(k)] for _ in range(g)]
    centred = cross_episode_advantages(rewards, gamma_trial=gamma, normalize="none")
    close(relative_attempt_advantages(rewards, gamma_trial=gamma, baseline="mean"), centred)
    loo = relative_attempt_advantages(rewards, gamma_trial=gamma, baseline="loo")
    close(loo, [[a * g / (g - 1) for a in row] for row in centred])


# -- reflections ----------------------------------------------------------------------------------


def test_reflection_gets_the_advantage_of_the_attempt_it_conditions():
    rewards = [[1], [0, 1], [0, 0, 1], [0, 0, 0]]
    adv = cross_episode_advantages(rewards, gamma_trial=0.5, normalize="none")
    # trial 2 failed attempts 0 and 1, then solved: its reflections (after attempts 0 and 1) get
    # the advantages of attempts 1 and 2: [0.0, 0.5], not those of the failed attempts they analyse
    assert reflection_advantages(adv[2], 2) == [adv[2][1], adv[2][2]] == [0.0, 0.5]
    # trial 3 never solved: its two reflections get attempts 1 and 2's [-0.5, -0.5]
    assert reflection_advantages(adv[3], 2) == [-0.5, -0.5]
    # a reflection written after the last attempt conditions nothing: 0
    assert reflection_advantages(adv[3], 3) == [-0.5, -0.5, 0.0]
    assert reflection_advantages(adv[0], 0) == []  # solved at once: no reflection
    with pytest.raises(ValueError, match="at most one reflection after each attempt"):
        reflection_advantages(adv[1], 3)
