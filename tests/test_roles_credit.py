"""Credit between the seats of a match (docs/multi-agent.md): group baselines per role, turn-level advantages per
role and SPIRAL's role-conditioned baselines, all worked out by hand."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from test_roles import Logged, kuhn_task  # (rootdir-relative, as conftest is imported elsewhere)

from ctxrl.algo.estimators import get_estimator
from ctxrl.algo.roles import rae_advantages
from ctxrl.envs.kuhn_poker import KuhnPokerEnv
from ctxrl.rollout.match import SeatPolicy, play_match
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.train.trainer import drop_small_groups
from ctxrl.types import Episode, Task, Turn

TASK = Task(id="t", prompt="p", answer="")
SQRT_HALF = math.sqrt(0.5)


def seat(group: int, role: str, reward: float) -> Episode:
    """A one-turn episode of ``role`` in ``group``: two sampled tokens after a prompt token."""
    return Episode(task=TASK, input_ids=[5, 6, 7], loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -0.5, -0.5],
                   turn_index=[-1, 0, 0], turns=[Turn(0, 1, 2, "stop", "x", reward=reward)], reward=reward,
                   group_id=group, role=role)


def advantage(rows) -> float:
    """The advantage on an episode's sampled tokens (the same on each)."""
    [row] = rows
    values = {a for a, m in zip(row.advantages, row.loss_mask) if m}
    assert len(values) == 1 and all(a == 0 for a, m in zip(row.advantages, row.loss_mask) if not m)
    return values.pop()


# group 0: two matches of player_0 against player_1; group 1: one more of each role
MATCHES = [seat(0, "player_0", 2.0), seat(0, "player_1", -2.0), seat(0, "player_0", -1.0), seat(0, "player_1", 1.0),
           seat(1, "player_0", 1.0), seat(1, "player_1", -1.0), seat(1, "player_0", 1.0), seat(1, "player_1", -1.0)]


def test_group_baselines_are_per_role():
    """rloo: A = r - mean of the other episodes of the same task group *and role*. Were the roles pooled,
    player_0's 2.0 would meet the mean of (-2, -1, 1) = -2/3 and get 2.67, not 3."""
    rloo = [advantage(rows) for rows in get_estimator("rloo")().estimate(MATCHES)]
    assert rloo == pytest.approx([2 - (-1), -2 - 1, -1 - 2, 1 - (-2), 0, 0, 0, 0])
    grpo = [advantage(rows) for rows in get_estimator("grpo")().estimate(MATCHES)]
    spread = math.sqrt(((2 - 0.5) ** 2 + (-1 - 0.5) ** 2) / 1)  # Bessel std of (2, -1)
    assert grpo == pytest.approx([1.5 / spread, -1.5 / spread, -1.5 / spread, 1.5 / spread, 0, 0, 0, 0], abs=1e-5)
    single = [seat(0, "", 2.0), seat(0, "", -2.0), seat(0, "", -1.0), seat(0, "", 1.0)]  # one role: one group
    assert [advantage(r) for r in get_estimator("rloo")().estimate(single)] == pytest.approx([
        2 - (-2 - 1 + 1) / 3, -2 - (2 - 1 + 1) / 3, -1 - (2 - 2 + 1) / 3, 1 - (2 - 2 - 1) / 3])


def test_small_groups_are_counted_per_role():
    kept, dropped = drop_small_groups([seat(0, "player_0", 1), seat(0, "player_0", 0), seat(0, "player_1", 1)])
    assert [e.role for e in kept] == ["player_0", "player_0"] and dropped == 1


def test_turn_level_advantages_per_role_on_recorded_matches(renderer):
    """Two hands of check-bet-call with the cards swapped: player_0 takes two turns (0, then the pot on the call),
    player_1 one. Per role and turn (gamma = 1): player_0's turn returns are (2, 2) and (-2, -2), so both turns get
    +-1/sqrt(2); player_1's one turn -2 and 2: -+1/sqrt(2). Pooled with player_1, player_0's turn 0 would be
    compared with (2, -2, -2, 2) and get 0.866."""
    limits = RolloutLimits(max_turns=4, max_new_tokens=16, max_total_tokens=1024)
    episodes = []
    for cards in ([3, 1], [1, 3]):
        engine = Logged(["check", "bet", "call"], renderer)
        seating = {role: SeatPolicy("shared", engine=engine) for role in KuhnPokerEnv.roles}
        episodes += asyncio.run(play_match(KuhnPokerEnv(), kuhn_task(cards, ["check", "bet", "call"]), seating,
                                           renderer, limits))
    assert [(e.role, e.reward, [t.reward for t in e.turns]) for e in episodes] == [
        ("player_0", 2.0, [0.0, 2.0]), ("player_1", -2.0, [-2.0]), ("player_0", -2.0, [0.0, -2.0]),
        ("player_1", 2.0, [2.0])]
    rows = get_estimator("turn_grpo")().estimate(episodes)
    for e, [row], sign in zip(episodes, rows, (1, -1, -1, 1)):
        by_turn = {}
        for a, m, t in zip(row.advantages, row.loss_mask, e.turn_index):
            if m:
                by_turn.setdefault(t, set()).add(round(a, 5))
        assert by_turn == {t.index: {round(sign * SQRT_HALF, 5)} for t in e.turns}


def test_role_conditioned_baselines_by_hand():
    """alpha = 0.5; advantages against the baseline before the step moves it (SPIRAL). Step 1: baselines 0, so
    A = the returns (2, -2, -1, 1); then player_0's returns (2, -1), mean 0.5: b = 0.5*0 + 0.5*0.5 = 0.25;
    player_1's (-2, 1), mean -0.5: b = -0.25. Step 2: player_0 returns 1: A = 1 - 0.25 = 0.75, then
    b = 0.5*0.25 + 0.5*1 = 0.625; player_1 keeps its baseline. With alpha = 0 and one episode a role a step,
    A = R - R_previous (not 0: an episode's own return is never its baseline)."""
    advantages, baselines = rae_advantages(torch.tensor([2.0, -2.0, -1.0, 1.0]), torch.tensor([0, 1, 0, 1]),
                                           torch.zeros(2), alpha=0.5)
    assert advantages.tolist() == pytest.approx([2.0, -2.0, -1.0, 1.0])
    assert baselines.tolist() == pytest.approx([0.25, -0.25])
    rae_cls = get_estimator("rae")
    rae = rae_cls(options=rae_cls.Settings(alpha=0.5))
    step1 = [advantage(r) for r in rae.estimate(MATCHES[:4])]
    assert step1 == pytest.approx([2.0, -2.0, -1.0, 1.0]) and rae.baselines == pytest.approx(
        {"player_0": 0.25, "player_1": -0.25})
    again = rae_cls(options=rae_cls.Settings(alpha=0.5))
    again.load_state_dict(rae.state_dict())  # what a checkpoint carries
    for estimator in (rae, again):
        assert [advantage(r) for r in estimator.estimate([seat(2, "player_0", 1.0)])] == pytest.approx([0.75])
        assert estimator.baselines == pytest.approx({"player_0": 0.625, "player_1": -0.25})
    assert not rae_cls.needs_groups and rae_cls.one_per_episode
    with pytest.raises(ValueError, match="carries no state"):
        get_estimator("grpo")().load_state_dict({"baselines": {}})
    first, b = rae_advantages(torch.tensor([3.0]), torch.tensor([0]), torch.zeros(1), alpha=0.0)
    second, _ = rae_advantages(torch.tensor([5.0]), torch.tensor([0]), b, alpha=0.0)
    assert first.tolist() == [3.0] and second.tolist() == [2.0]
    with pytest.raises(ValueError, match="alpha"):
        rae_advantages(torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.zeros(1), alpha=1.5)
