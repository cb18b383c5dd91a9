"""Trial statistics: success at / by attempt with early stops, unbiased pass@k, independent vs
sequential attempts, and exploration counts, against hand-derived values."""

from __future__ import annotations

import itertools
import math

import pytest

from ctxrl.algo.credit import cross_episode_returns
from ctxrl.meta.stats import (
    exploration_stats,
    independent_pass_at_k,
    independent_success_at_attempt,
    meta_metrics,
    pass_at_k,
    success_at_attempt,
    success_by_attempt,
    trial_exploration,
)
from ctxrl.meta.trial import Attempt, Trial

S = Attempt(1.0, True)
F = Attempt(0.0, False)


def trial(*attempts, task="a", k=3):
    return Trial(task_id=task, num_attempts=k, attempts=list(attempts))


# stop-on-success, K = 3: solved at attempt 0, at 1, at 2, never
LADDER = [trial(S), trial(F, S), trial(F, F, S), trial(F, F, F)]


def test_success_at_and_by_attempt_by_hand():
    # at: attempt 0 played by all four, 1 success -> 1/4; attempt 1 played by the last three
    # (the first stopped), 1 success -> 1/3; attempt 2 played by the last two, 1 success -> 1/2
    assert success_at_attempt(LADDER) == pytest.approx([1 / 4, 1 / 3, 1 / 2])
    # by: solved within attempt 0: 1 of 4; within 1: 2 of 4 (the absent attempts of the first
    # trial count as solved); within 2: 3 of 4
    assert success_by_attempt(LADDER) == [0.25, 0.5, 0.75]


def test_success_at_is_nan_where_no_trial_played_the_attempt():
    at = success_at_attempt([trial(S), trial(F, S)])
    assert at[:2] == [0.5, 1.0] and math.isnan(at[2])
    assert success_by_attempt([trial(S), trial(F, S)]) == [0.5, 1.0, 1.0]


def test_continuing_after_a_success_is_allowed():
    # a trial may keep going after a success (e.g. answers revised each attempt)
    trials = [trial(S, F, S), trial(F, S, F)]
    assert success_at_attempt(trials) == [0.5, 0.5, 0.5]
    assert success_by_attempt(trials) == [0.5, 1.0, 1.0]  # "by" counts the first success


def test_success_by_matches_the_cross_episode_return_of_attempt_zero():
    # with 0/1 rewards, stop-on-success and gamma_trial = 1, G_0 is "solved within K"
    for t in LADDER:
        solved = t.solved_at is not None
        assert cross_episode_returns(t.rewards, 1.0)[0] == float(solved)
    assert sum(cross_episode_returns(t.rewards, 1.0)[0] for t in LADDER) / 4 == success_by_attempt(LADDER)[-1]


# -- pass@k ---------------------------------------------------------------------------------------


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == 0.25  # c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    assert pass_at_k(6, 0, 3) == 0.0
    assert pass_at_k(6, 6, 1) == 1.0


def test_pass_at_k_equals_the_average_over_all_k_subsets():
    samples = [True, False, False, True, False]
    for k in range(1, 6):
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(5, 2, k) == pytest.approx(brute)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 0)


def test_independent_first_attempts_vs_sequential_attempts():
    # task a: the ladder, first attempts [S, F, F, F] -> pass@k = 1/4, 1/2, 3/4 (as by-attempt)
    # task b: every first attempt fails, three trials recover at attempt 1 -> pass@k = 0, while
    # success by attempt 2 and 3 is 3/4: what the feedback and reflection buy
    b = [trial(F, S, task="b"), trial(F, S, task="b"), trial(F, F, F, task="b"), trial(F, S, task="b")]
    assert [independent_pass_at_k(b, k) for k in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert success_by_attempt(b) == [0.0, 0.75, 0.75]
    both = LADDER + b
    # averaged over the two tasks: pass@2 = (1/2 + 0) / 2
    assert independent_pass_at_k(both, 2) == pytest.approx(0.25)
    assert success_by_attempt(both)[1] == pytest.approx((2 + 3) / 8)
    with pytest.raises(ValueError, match="task 'a' has 4 trials, fewer than k=5"):
        independent_pass_at_k(both, 5)


def test_independent_success_at_attempt_by_hand():
    # one task, first attempts [S, F, F, F] (n = 4, c = 1): sample 2 succeeds given sample 1 failed with 1/3,
    # sample 3 given two failures with 1/2; k = 1 is the plain success rate
    assert [independent_success_at_attempt(LADDER, k) for k in (1, 2, 3)] == pytest.approx([0.25, 1 / 3, 0.5])
    # pooled over tasks by the chance of reaching sample k: task b never succeeds (reach 1, solved 0)
    b = [trial(F, S, task="b"), trial(F, S, task="b"), trial(F, F, F, task="b"), trial(F, S, task="b")]
    assert independent_success_at_attempt(LADDER + b, 2) == pytest.approx((0.75 * 1 / 3) / (0.75 + 1.0))
    # brute force over every order of task a's four first attempts
    orders = list(itertools.permutations([True, False, False, False]))
    reached = [o for o in orders if not any(o[:2])]
    assert independent_success_at_attempt(LADDER, 3) == pytest.approx(sum(o[2] for o in reached) / len(reached))
    # every first attempt succeeds: no sample ever follows a failure
    assert math.isnan(independent_success_at_attempt([trial(S), trial(S)], 2))
    with pytest.raises(ValueError, match="fewer than k=3"):
        independent_success_at_attempt([trial(S), trial(F, S)], 3)


# -- exploration ----------------------------------------------------------------------------------


def _qa_trial(failed_answers_only: bool) -> Trial:
    explicit = (lambda *a: list(a)) if failed_answers_only else (lambda *a: None)
    return trial(
        Attempt(0.0, False, ["search:x", "answer:1"], explicit("answer:1")),
        Attempt(0.0, False, ["search:x", "search:y", "answer:1"], explicit("answer:1")),
        Attempt(1.0, True, ["search:y", "answer:2"]),
    )


def test_repeated_failed_actions_attempt_level_by_hand():
    # failed_actions unset: a failed attempt's actions all count as failed
    # attempt 1 repeats search:x and answer:1 of failed attempt 0 -> 2
    # attempt 2 repeats search:y of failed attempt 1 -> 1; total 3 of 3 + 2 later distinct actions
    stats = trial_exploration(_qa_trial(failed_answers_only=False))
    assert stats == {"actions": 7, "distinct_actions": 4, "repeated_failed_actions": 3, "later_attempt_actions": 5}


def test_repeated_failed_actions_with_the_environments_failures():
    # the environment says only the wrong answer failed: attempt 1 repeats answer:1 -> 1; attempt 2 nothing
    stats = trial_exploration(_qa_trial(failed_answers_only=True))
    assert stats["repeated_failed_actions"] == 1 and stats["distinct_actions"] == 4


def test_actions_repeated_within_an_attempt_count_once_and_successes_fail_nothing():
    t = trial(Attempt(0.0, False, ["L", "L"]), Attempt(0.0, False, ["L", "L", "L"]), Attempt(1.0, True, ["R"]))
    assert trial_exploration(t) == {"actions": 6, "distinct_actions": 2, "repeated_failed_actions": 1,
                                    "later_attempt_actions": 2}
    after_success = trial(Attempt(1.0, True, ["U"]), Attempt(0.0, False, ["U"]), Attempt(0.0, False, ["U"]))
    # U did not fail in attempt 0; it did fail in attempt 1, so attempt 2 repeats a failed action
    assert trial_exploration(after_success)["repeated_failed_actions"] == 1


def test_exploration_stats_means_and_pooled_rate():
    trials = [_qa_trial(False), _qa_trial(True)]
    stats = exploration_stats(trials)
    assert stats == {"actions": 7.0, "distinct_actions": 4.0, "repeated_failed_actions": 2.0,
                     "repeated_failed_rate": 0.4}  # (3 + 1) / (5 + 5)
    assert exploration_stats([trial(Attempt(1.0, True, ["a"]))])["repeated_failed_rate"] == 0.0


# -- validation and the metrics dict --------------------------------------------------------------


def test_bad_trials_raise_with_the_fix():
    with pytest.raises(ValueError, match="stop early only on a success"):
        success_by_attempt([trial(F, F)])
    with pytest.raises(ValueError, match="more than its budget num_attempts=2"):
        success_at_attempt([trial(F, F, S, k=2)])
    with pytest.raises(ValueError, match="different budgets num_attempts=\\[2, 3\\]"):
        success_at_attempt([trial(S, k=2), trial(S, k=3)])
    with pytest.raises(ValueError, match="has no attempts"):
        exploration_stats([trial()])
    with pytest.raises(ValueError, match="no trials"):
        success_by_attempt([])
    with pytest.raises(ValueError, match="num_attempts must be >= 1"):
        trial(S, k=0).check()


def test_meta_metrics_dict():
    metrics = meta_metrics(LADDER)
    assert metrics["success_at_2"] == pytest.approx(1 / 3)
    assert [metrics[f"success_by_{k}"] for k in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert [metrics[f"pass_at_{k}"] for k in (1, 2, 3)] == pytest.approx([0.25, 0.5, 0.75])
    assert metrics["attempts"] == (1 + 2 + 3 + 3) / 4
    assert "exploration/repeated_failed_rate" in metrics
    # two trials per task: pass@3 is not reported
    two = meta_metrics([trial(S), trial(F, S)])
    assert "pass_at_2" in two and "pass_at_3" not in two
    assert metrics["independent_success_at_3"] == pytest.approx(0.5) and "independent_success_at_3" not in two
