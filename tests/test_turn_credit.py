"""Turn credit when the agent chooses how many turns to take (issue 52): ``turn_loo`` against ``turn_grpo``.

The length-bias test enumerates every outcome of a small batch of independent groups exactly (no sampling): each
episode chooses its length (stop or continue at each turn) and gets rewards whose expectation does not depend on that
choice, so the true advantage of every action is 0. An estimator whose baseline does not depend on the scored action,
and compares each turn with returns of the same turn, must then give advantages with expectation 0 at every turn, for
every turn count. ``turn_grpo`` (per-turn-index group normalisation) fails it: its std includes the scored return, so
it favours the low-variance choice.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch
from test_estimators import EPISODES, _episode  # (rootdir-relative, as conftest is imported elsewhere)

from ctxrl.algo.advantages import rloo_advantages
from ctxrl.algo.estimators import get_estimator, token_advantages
from ctxrl.algo.turns import episode_turn_tensors, turn_advantages, turn_loo_advantages, turn_returns
from ctxrl.sections import AlgoConfig

# -- the definition, by hand ---------------------------------------------------------------------

REWARDS = torch.tensor([[0.0, 1.0], [0.5, 0.0], [1.0, 9.0]])  # 9.0 sits on a padding turn
LIVE = torch.tensor([[1, 1], [1, 1], [1, 0]])


def test_turn_loo_by_hand():
    # returns (gamma 1): [[1, 1], [0.5, 0], [1, -]]
    # turn 0, all three: 1 - (0.5 + 1)/2 = 0.25; 0.5 - (1 + 1)/2 = -0.5; 1 - (1 + 0.5)/2 = 0.25
    # turn 1, episodes 0 and 1: 1 - 0 = 1; 0 - 1 = -1; episode 2 never took turn 1: 0
    adv = turn_loo_advantages(REWARDS, LIVE, torch.tensor([0, 0, 0]))
    torch.testing.assert_close(adv, torch.tensor([[0.25, 1.0], [-0.5, -1.0], [0.25, 0.0]]))
    # gamma 0.5: returns [[0.5, 1], [0.5, 0], [1, -]]; turn 0: 0.5 - 0.75, 0.5 - 0.75, 1 - 0.5
    adv = turn_loo_advantages(REWARDS, LIVE, torch.tensor([0, 0, 0]), gamma=0.5)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-0.25, -0.25, 0.5]))


def test_lone_episode_at_a_turn_falls_back_to_the_same_turn_of_other_groups():
    # group 0: returns [[2, 1], [0, -]]; group 1: [[1, 0.5], [1, -]]. Turn 0: 2 - 0, 0 - 2; 1 - 1, 1 - 1.
    # Turn 1: each group has one episode there; its baseline is the other group's return at turn 1 (not its whole
    # return: episode 0 would get 1 - 1 = 0 from G[2,0] where its turn-1 return beats the others' by 0.5)
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.5, 0.5], [1.0, 0.0]])
    live, groups = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]]), torch.tensor([0, 0, 1, 1])
    adv = turn_loo_advantages(rewards, live, groups)
    torch.testing.assert_close(adv, torch.tensor([[2.0, 0.5], [-2.0, 0.0], [0.0, -0.5], [0.0, 0.0]]))
    # alone in the batch, a lone turn has nothing to compare with: 0, as turn_grpo gives it
    torch.testing.assert_close(turn_loo_advantages(rewards[:2], live[:2], groups[:2]),
                               torch.tensor([[2.0, 0.0], [-2.0, 0.0]]))
    assert turn_advantages(rewards[:2], live[:2], groups[:2])[0, 1] == 0.0
    # a group of one compares every turn with the other groups (and alone in the batch gets 0)
    torch.testing.assert_close(turn_loo_advantages(rewards[:3], live[:3], torch.tensor([0, 0, 7]))[2],
                               torch.tensor([1.0 - 1.0, 0.5 - 1.0]))
    assert turn_loo_advantages(rewards[:1], live[:1], torch.tensor([7])).tolist() == [[0.0, 0.0]]


def test_the_fallback_leaves_out_the_seats_of_the_scored_episodes_task_group():
    # task 0: a solver with two turns, a solver with one, a proposer (another group) with two; task 1: two solvers
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 5.0], [0.0, 0.5], [0.0, 0.0]])
    live = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    groups, tasks = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([0, 0, 0, 1, 1])
    # the solver's lone turn 1 is compared with task 1's (0.5), not with the proposer of its own match (5), whose
    # return may depend on the solver's actions
    adv = turn_loo_advantages(rewards, live, groups, task_group_ids=tasks)
    assert float(adv[0, 1]) == pytest.approx(1.0 - 0.5)
    # the proposer (a group of one) compares with task 1 as well: 5 - 0.5 at turn 1, 5 - 0.25 at turn 0
    torch.testing.assert_close(adv[2], torch.tensor([5.0 - 0.25, 5.0 - 0.5]))
    # without task groups every group is its own task: the proposer counts for the solver
    assert float(turn_loo_advantages(rewards, live, groups)[0, 1]) == pytest.approx(1.0 - (5.0 + 0.5) / 2)


def test_leave_one_out_by_definition_on_random_groups():
    g = torch.Generator().manual_seed(0)
    n, k = 12, 4
    rewards = torch.randn(n, k, generator=g)
    lengths = torch.randint(1, k + 1, (n,), generator=g)
    live = (torch.arange(k) < lengths.unsqueeze(1)).float()
    groups = torch.tensor([3, 1, 3, 3, 1, 8, 1, 3, 1, 3, 8, 5])  # interleaved; group 5 is a singleton
    tasks = torch.tensor([0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 2, 9])  # groups 3 and 1 are two roles of task 0
    adv = turn_loo_advantages(rewards, live, groups, task_group_ids=tasks, gamma=0.9)
    returns = turn_returns(rewards, live, 0.9)
    expected = torch.zeros(n, k)
    for i in range(n):
        for t in range(int(lengths[i])):
            cell = [returns[j, t] for j in range(n) if j != i and groups[j] == groups[i] and live[j, t]]
            outside = [returns[j, t] for j in range(n) if tasks[j] != tasks[i] and live[j, t]]
            if cell or outside:
                expected[i, t] = returns[i, t] - sum(cell or outside) / len(cell or outside)
    torch.testing.assert_close(adv, expected)
    # noise on padding turns changes nothing
    noisy = rewards + torch.randn(n, k, generator=g) * (1 - live) * 100
    torch.testing.assert_close(turn_loo_advantages(noisy, live, groups, task_group_ids=tasks, gamma=0.9), adv)


def test_the_baseline_never_depends_on_the_scored_episode_or_its_task_groups_other_seats():
    g = torch.Generator().manual_seed(1)
    n, k = 12, 4
    groups = torch.tensor([3, 1, 3, 3, 1, 8, 1, 3, 1, 3, 8, 5])
    tasks = torch.tensor([0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 2, 9])

    def draw():
        lengths = torch.randint(1, k + 1, (n,), generator=g)
        return torch.randn(n, k, generator=g), (torch.arange(k) < lengths.unsqueeze(1)).float()

    rewards, live = draw()
    baseline = turn_returns(rewards, live) - turn_loo_advantages(rewards, live, groups, task_group_ids=tasks)
    for i in range(n):
        # redraw episode i (rewards and turn count) and every episode of its task group outside its group
        other_rewards, other_live = draw()
        redrawn = (torch.arange(n) == i) | ((tasks == tasks[i]) & (groups != groups[i]))
        r = torch.where(redrawn.unsqueeze(1), other_rewards, rewards)
        m = torch.where(redrawn.unsqueeze(1), other_live, live)
        again = turn_returns(r, m) - turn_loo_advantages(r, m, groups, task_group_ids=tasks)
        both = (live[i] * m[i]).bool()  # the turns episode i reached in both draws
        torch.testing.assert_close(again[i][both], baseline[i][both])


@pytest.mark.parametrize("seed", range(3))
def test_single_turn_equals_rloo(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (12,), generator=g).float()
    groups = torch.arange(12) // 4
    adv = turn_loo_advantages(rewards.unsqueeze(1), torch.ones(12, 1), groups)
    torch.testing.assert_close(adv[:, 0], rloo_advantages(rewards, groups))


def test_shape_errors():
    with pytest.raises(ValueError, match="must be equal"):
        turn_loo_advantages(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(ValueError, match="group_ids"):
        turn_loo_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="task_group_ids"):
        turn_loo_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), task_group_ids=torch.zeros(3))


# -- the length-bias test ------------------------------------------------------------------------

# Each synthetic episode is (turn rewards, probability): its length is its own choice (stop or continue at each
# turn), and the expected return from any turn is 0.5 whichever it chooses, so no action changes the expected
# return. Only the spread depends on the choice.
OUTCOME_ONLY = [  # the outcome on the last turn; one turn: 0.5 surely, two: 0 or 1, three: 0 or 2 (mean 0.5)
    ((0.5,), 1 / 3),
    ((0.0, 0.0), 1 / 6), ((0.0, 1.0), 1 / 6),
    ((0.0, 0.0, 0.0), 1 / 4), ((0.0, 0.0, 2.0), 1 / 12),
]
TURN_NOISE = [  # the same outcomes, plus a zero-mean reward of +-1 on every turn before the last
    (tuple(noise) + (outcome,), p / 2 ** len(noise))
    for rewards, p in OUTCOME_ONLY
    for outcome in [rewards[-1]]
    for noise in itertools.product((-1.0, 1.0), repeat=len(rewards) - 1)
]
TURN_SCALED = [  # rewards on every turn, scaled so that the return from turn 0 is 1 whatever the length, and the
    # return from turn k the same for every length that reaches k (0.5 from turn 1, 0.25 from turn 2): again no
    # action changes the expected return, but the returns at late turns are smaller than the whole return
    ((1.0,), 1 / 3), ((0.5, 0.5), 1 / 3), ((0.5, 0.25, 0.25), 1 / 3),
]
SUPPORTS = {"outcome": OUTCOME_ONLY, "turn_noise": TURN_NOISE, "turn_scaled": TURN_SCALED}


def enumerate_batches(groups):
    """Every batch of independent groups, ``groups`` = [(support, size), ...] (each of a group's ``size`` episodes
    drawn from its ``support``), with its probability: (turn_rewards [N,K], turn_mask [N,K], group_ids [N],
    lengths [N], probability)."""
    k = max(len(r) for support, _ in groups for r, _ in support)
    seats = [support for support, size in groups for _ in range(size)]  # what each episode of a batch draws from
    draws = torch.tensor(list(itertools.product(*(range(len(support)) for support in seats))))  # [B, N]
    rewards = torch.zeros(*draws.shape, k, dtype=torch.float64)
    lengths = torch.zeros(draws.shape, dtype=torch.long)
    probabilities = torch.ones(len(draws), dtype=torch.float64)
    for i, support in enumerate(seats):
        table = torch.tensor([list(r) + [0.0] * (k - len(r)) for r, _ in support], dtype=torch.float64)
        rewards[:, i] = table[draws[:, i]]
        lengths[:, i] = torch.tensor([len(r) for r, _ in support])[draws[:, i]]
        probabilities *= torch.tensor([p for _, p in support], dtype=torch.float64)[draws[:, i]]
    assert abs(float(probabilities.sum()) - 1.0) < 1e-12
    live = (torch.arange(k) < lengths.unsqueeze(-1)).double()
    group_ids = torch.tensor([g for g, (_, size) in enumerate(groups) for _ in range(size)])
    for b in range(len(draws)):
        yield rewards[b], live[b], group_ids, lengths[b].tolist(), float(probabilities[b])


def expected_advantages(advantage_fn, groups):
    """Exact ``E[A[i,k] | episode i took L turns]`` for every turn ``k < L`` of the episodes ``i`` of the first group
    (the others are the rest of the batch): {(k, L): value}. ``advantage_fn(turn_rewards, turn_mask, group_ids)``
    sees one batch at a time."""
    sums, weights = defaultdict(float), defaultdict(float)
    for rewards, live, group_ids, lengths, probability in enumerate_batches(groups):
        adv = advantage_fn(rewards.float(), live.float(), group_ids).double().tolist()
        for i in range(groups[0][1]):
            for k in range(lengths[i]):
                sums[(k, lengths[i])] += probability * adv[i][k]
                weights[(k, lengths[i])] += probability
    return {cell: sums[cell] / weights[cell] for cell in sorted(sums, key=lambda cell: (cell[1], cell[0]))}


def assert_no_length_bias(means, tol=1e-6):
    """Every turn of every turn count has expected advantage 0 (so stopping and continuing, which earn the same
    expected return, get the same expected credit and the expected gradient is 0, as the true one is)."""
    biased = {cell: round(v, 4) for cell, v in means.items() if abs(v) > tol}
    assert not biased, f"expected advantage != 0 at (turn, turn count): {biased}"


# The batch is the scored group and an independent group of the same task, so that the fallback to other groups is
# exercised; its sizes keep the enumeration (support size ** episodes calls) to a few thousand batches.
BATCHES = {"outcome": (3, 1), "turn_noise": (2, 1), "turn_scaled": (3, 3)}


@pytest.mark.parametrize("support", SUPPORTS)
def test_turn_loo_has_no_length_bias(support):
    means = expected_advantages(turn_loo_advantages, [(SUPPORTS[support], size) for size in BATCHES[support]])
    assert len(means) == 6  # turns 0..L-1 for L = 1, 2, 3
    assert_no_length_bias(means)


def test_turn_loo_with_another_task_in_the_fallback_is_the_same_for_every_turn_count():
    """Where the other group is another task, with a larger expected return at turn 1 (1 instead of 0.5), the
    fallback's expected advantage is not 0; but it is the same whatever the scored episode's turn count, so it
    still prefers neither stopping nor continuing (the gradient stays unbiased; the offset is variance)."""
    other_task = [(tuple(2 * r for r in rewards), p) for rewards, p in OUTCOME_ONLY]  # 1 from every turn
    means = expected_advantages(turn_loo_advantages, [(TURN_SCALED, 2), (other_task, 1)])
    # turn 1, fallback when the scored episode's group mate stopped at turn 0 (1/3) and the other task's episode
    # reached turn 1 (2/3): (0.5 - 1) * 1/3 * 2/3
    assert means[(1, 2)] == pytest.approx(-1 / 9, abs=1e-6) and means[(1, 3)] == pytest.approx(-1 / 9, abs=1e-6)
    assert means[(0, 1)] == means[(0, 2)] == means[(0, 3)] == 0.0


@pytest.mark.parametrize("support", ["outcome", "turn_noise"])
def test_turn_grpo_fails_the_length_bias_test(support):
    means = expected_advantages(turn_advantages, [(SUPPORTS[support], 3)])
    with pytest.raises(AssertionError, match="expected advantage"):
        assert_no_length_bias(means)
    # and the bias is a gradient: at turn 0 stopping (the sure 0.5) gets more expected credit than continuing,
    # so turn_grpo teaches the policy to stop although both choices earn 0.5 in expectation
    continuing = [means[(0, 2)], means[(0, 3)]]
    assert means[(0, 1)] > 0.05 and means[(0, 1)] > max(continuing) + 0.05


def test_turn_grpo_bias_is_its_std():
    """Centred only, turn_grpo's cells are a leave-one-out scaled by (n-1)/n: no bias in expectation here; the
    failure above comes from dividing by a std that includes the scored return."""
    centred = expected_advantages(lambda r, m, g: turn_advantages(r, m, g, std_normalize=False), [(OUTCOME_ONLY, 3)])
    assert_no_length_bias(centred)


# -- the estimator -------------------------------------------------------------------------------


def test_estimator_puts_each_turns_advantage_on_its_tokens():
    episodes = [_episode(0, [0.0, 1.0]), _episode(0, [0.0]), _episode(1, [0.5, 0.5]), _episode(1, [1.0])]
    out = token_advantages("turn_loo", episodes)
    # returns: (1, 1), (0) | (1, 0.5), (1). Turn 0: +1 / -1 | 0 / 0. Turn 1, one episode per group: compared with the
    # other group's return at turn 1: 1 - 0.5 = 0.5 and 0.5 - 1 = -0.5
    sampled = [[a for a, m in zip(adv, e.loss_mask) if m] for adv, e in zip(out, episodes)]
    assert sampled == [[1.0, 1.0, 0.5, 0.5], [-1.0, -1.0], [0.0, 0.0, -0.5, -0.5], [0.0, 0.0]]
    assert all(a == 0.0 for adv, e in zip(out, episodes) for a, m in zip(adv, e.loss_mask) if not m)
    assert get_estimator("turn_loo").accepts_token_rewards and get_estimator("turn_loo").needs_groups


def test_estimator_falls_back_outside_the_scored_episodes_task_group():
    episodes = [_episode(0, [0.0, 1.0]), _episode(0, [0.0]), _episode(0, [0.0, 5.0]), _episode(1, [0.0, 0.5]),
                _episode(1, [0.0])]
    episodes[2].role = "proposer"  # the other seat of task 0's match: its return may depend on the solver's actions
    out = token_advantages("turn_loo", episodes)
    assert [a for a, m in zip(out[0], episodes[0].loss_mask) if m][2:] == pytest.approx([1.0 - 0.5] * 2)


def test_estimator_matches_the_pure_function_with_token_rewards():
    penalties = [[-0.1 if m else 0.0 for m in e.loss_mask] for e in EPISODES]
    out = token_advantages("turn_loo", EPISODES, AlgoConfig(gamma=0.9), token_rewards=penalties)
    rewards, live = episode_turn_tensors(EPISODES)
    rewards = rewards - 0.2 * live  # two sampled tokens per turn, -0.1 each
    adv = turn_loo_advantages(rewards, live, torch.tensor([0, 0, 1, 1]), gamma=0.9)
    for row, e, turn_adv in zip(out, EPISODES, adv):
        expected = [float(turn_adv[t]) if m else 0.0 for t, m in zip(e.turn_index, e.loss_mask)]
        assert row == pytest.approx(expected, abs=1e-6)


def test_estimator_refuses_segmented_episodes():
    e = _episode(0, [1.0])
    e.segments = [e.sequences()[0]]
    with pytest.raises(ValueError, match="turn_loo estimator computes per-token advantages"):
        token_advantages("turn_loo", [e, _episode(0, [0.0])])
