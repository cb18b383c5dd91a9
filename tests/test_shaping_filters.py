"""Reward shaping (DAPO overlong, OTC, format, composition) and update filters (DAPO, SimpleTIR)."""

from __future__ import annotations

import math

import pytest

from ctxrl.algo.filters import informative_groups, void_turn_free, void_turns
from ctxrl.algo.shaping import (
    compose,
    format_reward,
    group_optimal_calls,
    otc_reward,
    otc_tool_reward,
    overlong_penalty,
)
from ctxrl.types import Episode, Task, Turn


def test_overlong_penalty_by_hand():
    # max 100, buffer 20: free up to 80, then linear to -1 at 100, -1 beyond
    assert overlong_penalty(50, 100, 20) == 0.0
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20) == pytest.approx(-1.0)
    assert overlong_penalty(130, 100, 20) == -1.0
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(10, 100, 0)


def test_otc_tool_reward_by_hand():
    # unknown optimum (OTC-PPO): cos(m pi / (2m + c)); c = 1: m=0 -> 1, m=1 -> cos(pi/3) = 0.5
    assert otc_tool_reward(0, None) == pytest.approx(1.0)
    assert otc_tool_reward(1, None) == pytest.approx(0.5)
    assert otc_tool_reward(2, None) == pytest.approx(math.cos(2 * math.pi / 5))
    # n = 0 known: no calls is best
    assert otc_tool_reward(0, 0) == 1.0
    assert otc_tool_reward(1, 0) == pytest.approx(0.5)
    # n = 2: f = 2nm/(m+n); m = n -> sin(pi/2) = 1; m = 4 -> f = 16/6, sin(f pi / 4) = sin(2pi/3)
    assert otc_tool_reward(2, 2) == pytest.approx(1.0)
    assert otc_tool_reward(4, 2) == pytest.approx(math.sin(2 * math.pi / 3))
    assert otc_tool_reward(0, 2) == pytest.approx(0.0)
    assert otc_tool_reward(1, 2) == pytest.approx(math.sin((4 / 3) * math.pi / 4))
    # more calls than needed: monotonically worse
    assert otc_tool_reward(3, 1) > otc_tool_reward(5, 1) > otc_tool_reward(9, 1) > 0
    with pytest.raises(ValueError):
        otc_tool_reward(-1, None)


def test_otc_reward_needs_correctness():
    assert otc_reward(0.0, 1, 1) == 0.0
    assert otc_reward(1.0, 1, 1, alpha=2.0) == pytest.approx(2.0)
    assert group_optimal_calls([3, 1, 2, 0, 5], [True, True, False, False, True], [0, 0, 0, 1, 1]) == {0: 1, 1: 5}
    assert group_optimal_calls([2], [False], [7]) == {7: None}


def test_format_and_compose():
    assert format_reward([0, 0]) == 1.0 and format_reward([0, 1]) == 0.0 and format_reward([]) == 1.0
    total, terms = compose({"correct": 1.0, "format": 0.0, "otc": 0.5}, {"correct": 1.0, "otc": 0.5})
    assert total == pytest.approx(1.25)
    assert terms == {"reward_correct": 1.0, "reward_format": 0.0, "reward_otc": 0.5}
    with pytest.raises(ValueError, match="unknown terms \\['speed'\\]"):
        compose({"correct": 1.0}, {"speed": 1.0})


def test_informative_groups():
    keep = informative_groups([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0], [0, 0, 1, 1, 2, 2, 3])
    assert keep == [True, True, False, False, False, False, False]


def _ep(turns: list[tuple[int, int]], truncation=None) -> Episode:
    """turns: (tool_calls, malformed_calls) per turn."""
    e = Episode(task=Task(id="x", prompt="", answer=""), truncation=truncation)
    e.turns = [Turn(index=k, prompt_tokens=0, sampled_tokens=1, finish_reason="stop", text="", tool_calls=c,
                    malformed_calls=m) for k, (c, m) in enumerate(turns)]
    return e


def test_void_turns():
    assert void_turns(_ep([(1, 0), (0, 0)])) == []                      # call, then an answer
    assert void_turns(_ep([(0, 0)])) == []                              # a direct answer
    assert void_turns(_ep([(0, 0), (1, 0), (0, 0)])) == [0]             # chatter, then call, answer
    assert void_turns(_ep([(1, 1), (0, 0)])) == [0]                     # only a malformed call
    assert void_turns(_ep([(2, 1), (0, 0)])) == []                      # one of two calls parsed
    assert void_turns(_ep([(1, 0), (1, 0)], truncation="max_turns")) == []
    assert void_turns(_ep([(1, 0), (0, 0)], truncation="max_new_tokens")) == [1]  # cut off, no call
    assert void_turn_free([_ep([(1, 0), (0, 0)]), _ep([(0, 0), (0, 0)])]) == [True, False]
    # the environment's own word wins: a final turn it did not take as an answer is void
    e = _ep([(1, 0), (0, 0)])
    e.turns[-1].answered = False
    assert void_turns(e) == [1]
    e.turns[-1].answered = True
    assert void_turns(e) == []


def test_shape_rewards_in_place():
    from ctxrl.config import RewardConfig
    from ctxrl.train.rewards import shape_rewards

    def ep(group, reward, success, calls, tokens, errors=0):
        e = Episode(task=Task(id="x", prompt="", answer=""), group_id=group, reward=reward, success=success)
        e.input_ids = [1] * tokens
        e.turns = [Turn(index=0, prompt_tokens=0, sampled_tokens=1, finish_reason="stop", text="", tool_calls=calls,
                        tool_errors=errors),
                   Turn(index=1, prompt_tokens=0, sampled_tokens=1, finish_reason="stop", text="", reward=reward)]
        return e

    # defaults: no shaping at all, nothing touched
    plain = [ep(0, 1.0, True, 1, 10)]
    assert shape_rewards(plain, RewardConfig(), max_total_tokens=100) == {}
    assert plain[0].reward == 1.0 and "env_reward" not in plain[0].info
    episodes = [ep(0, 1.0, True, 2, 50), ep(0, 1.0, True, 1, 95), ep(0, 0.0, False, 0, 10, errors=1)]
    rc = RewardConfig(outcome=0.5, overlong_buffer=10, otc_weight=1.0, format_weight=0.25)
    means = shape_rewards(episodes, rc, max_total_tokens=100)
    # group optimum n = 1 call: episode 0 (m=2): sin(f pi/2), f = 4/3 -> 0.866; episode 1 (m=1): 1
    # episode 1 is 95 tokens: overlong (90 - 95) / 10 = -0.5
    expected = [0.5 + math.sin((4 / 3) * math.pi / 2) + 0.25, 0.5 - 0.5 + 1.0 + 0.25, 0.0]
    for e, want in zip(episodes, expected):
        assert e.reward == pytest.approx(want)
        assert sum(t.reward for t in e.turns) == pytest.approx(want)  # the turns add up to the episode
    assert episodes[2].info["reward_terms"] == {"reward_outcome": 0.0, "reward_overlong": 0.0, "reward_otc": 0.0,
                                               "reward_format": 0.0}
    assert means["reward_otc"] == pytest.approx((math.sin((4 / 3) * math.pi / 2) + 1.0) / 3)


def test_shape_rewards_reweights_every_turn():
    """With outcome weight 0, an earlier turn's env reward must not survive in the turn rewards."""
    from ctxrl.config import RewardConfig
    from ctxrl.train.rewards import shape_rewards

    e = Episode(task=Task(id="x", prompt="", answer=""), reward=1.5, success=True)
    e.input_ids = [1] * 10
    e.turns = [Turn(index=0, prompt_tokens=0, sampled_tokens=1, finish_reason="stop", text="", reward=0.5),
               Turn(index=1, prompt_tokens=0, sampled_tokens=1, finish_reason="stop", text="", reward=1.0)]
    shape_rewards([e], RewardConfig(outcome=0.0, format_weight=1.0), max_total_tokens=100)
    assert [t.reward for t in e.turns] == [0.0, 1.0] and e.reward == 1.0
