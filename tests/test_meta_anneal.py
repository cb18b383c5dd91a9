"""Annealed demonstrations: schedules by hand, exactly zero at and after `steps`, seeded sampling,
zero-shot evaluation, and clear errors for bad settings."""

from __future__ import annotations

import math

import pytest

from ctxrl.meta.anneal import KINDS, DemoSchedule, demo_count, demo_probability, num_demos, sample_demos


def test_linear_count_by_hand():
    # ceil(4 * (10 - t) / 10): 4, 3.6, 3.2 -> 4; 2.8, 2.4 -> 3; 2, 1.6, 1.2 -> 2; 0.8, 0.4 -> 1; then 0
    counts = [demo_count(t, start=4, steps=10) for t in range(13)]
    assert counts == [4, 4, 4, 3, 3, 2, 2, 2, 1, 1, 0, 0, 0]


def test_cosine_count_by_hand():
    # 4 * (1 + cos(pi t / 10)) / 2 = 4, 3.90, 3.62, 3.18, 2.62, 2 (exact: stays 2), 1.38, .82, .38, .10, 0
    counts = [demo_count(t, start=4, steps=10, kind="cosine") for t in range(12)]
    assert counts == [4, 4, 4, 4, 3, 2, 2, 1, 1, 1, 0, 0]


def test_step_count_is_constant_then_zero():
    assert [demo_count(t, start=3, steps=4, kind="step") for t in range(7)] == [3, 3, 3, 3, 0, 0, 0]


def test_probability_by_hand():
    assert demo_probability(0, steps=4) == 1.0
    assert demo_probability(1, start=0.8, steps=4) == pytest.approx(0.6)  # 0.8 * 3/4
    assert demo_probability(2, steps=4, kind="cosine") == pytest.approx(0.5)  # (1 + cos(pi/2)) / 2
    assert demo_probability(3, start=0.5, steps=4, kind="step") == 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_every_schedule_reaches_zero_at_steps_and_stays(kind):
    for steps in (1, 2, 7, 100):
        before = [demo_count(t, start=5, steps=steps, kind=kind) for t in range(steps)]
        assert all(c >= 1 for c in before)  # counts round up: at least one demo until `steps`
        assert before == sorted(before, reverse=True)  # never grows back
        assert all(demo_count(t, start=5, steps=steps, kind=kind) == 0 for t in range(steps, steps + 50))
        probs = [demo_probability(t, steps=steps, kind=kind) for t in range(steps + 50)]
        assert all(p > 0 for p in probs[:steps]) and all(p == 0.0 for p in probs[steps:])
        assert probs[:steps] == sorted(probs[:steps], reverse=True)


def test_steps_zero_means_no_demos_and_start_zero_means_none():
    for kind in KINDS:
        assert demo_count(0, start=4, steps=0, kind=kind) == 0
        assert demo_probability(0, steps=0, kind=kind) == 0.0
        assert demo_count(0, start=0, steps=10, kind=kind) == 0


def test_bad_settings_raise_with_the_fix():
    with pytest.raises(ValueError, match="steps must be >= 0"):
        demo_count(0, start=2, steps=-1)
    with pytest.raises(ValueError, match="step must be >= 0"):
        demo_probability(-1, steps=10)
    with pytest.raises(ValueError, match="kind must be one of"):
        demo_count(0, start=2, steps=10, kind="exp")
    with pytest.raises(ValueError, match="start must be >= 0"):
        demo_count(0, start=-1, steps=10)
    with pytest.raises(ValueError, match=r"start must be a probability in \[0, 1\]"):
        demo_probability(0, start=1.5, steps=10)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        DemoSchedule(max_demos=2, steps=-5)
    with pytest.raises(ValueError, match="mode must be one of"):
        DemoSchedule(max_demos=2, steps=5, mode="sometimes")
    with pytest.raises(ValueError, match="max_demos must be >= 0"):
        DemoSchedule(max_demos=-1, steps=5)


# -- sampling -------------------------------------------------------------------------------------


def test_evaluation_is_always_zero_shot():
    for mode in ("count", "probability"):
        schedule = DemoSchedule(max_demos=3, steps=100, mode=mode)
        for episode in range(20):
            assert num_demos(schedule, step=0, seed=1, episode_index=episode, evaluation=True) == 0
            assert sample_demos(schedule, step=0, pool_size=10, seed=1, episode_index=episode, evaluation=True) == []


def test_count_mode_is_the_schedule():
    schedule = DemoSchedule(max_demos=4, steps=10)
    counts = [num_demos(schedule, step=t, seed=0, episode_index=0, evaluation=False) for t in (0, 3, 8, 10)]
    assert counts == [4, 3, 1, 0]


def test_probability_mode_is_all_or_nothing_at_the_scheduled_rate():
    schedule = DemoSchedule(max_demos=2, steps=4, mode="probability")  # linear: p = 1, .75, .5, .25, 0
    for step, p in [(0, 1.0), (2, 0.5), (3, 0.25), (4, 0.0)]:
        draws = [num_demos(schedule, step=step, seed=7, episode_index=e, evaluation=False) for e in range(4000)]
        assert set(draws) <= {0, 2}
        rate = draws.count(2) / len(draws)
        assert abs(rate - p) < 0.03, (step, rate)  # 4000 draws: std <= 0.008


def test_sampling_is_a_pure_function_of_seed_step_episode():
    schedule = DemoSchedule(max_demos=3, steps=10, mode="probability")
    a = [sample_demos(schedule, step=2, pool_size=8, seed=5, episode_index=e, evaluation=False) for e in range(50)]
    b = [sample_demos(schedule, step=2, pool_size=8, seed=5, episode_index=e, evaluation=False)
         for e in reversed(range(50))]
    assert a == list(reversed(b))  # same episode, same demos, whatever the order of calls
    c = [sample_demos(schedule, step=2, pool_size=8, seed=6, episode_index=e, evaluation=False) for e in range(50)]
    assert a != c
    for picked in a:
        assert len(picked) in (0, 3) and len(set(picked)) == len(picked) and all(0 <= i < 8 for i in picked)


def test_sample_demos_needs_a_big_enough_pool():
    schedule = DemoSchedule(max_demos=3, steps=10)
    with pytest.raises(ValueError, match="pool holds 2"):
        sample_demos(schedule, step=0, pool_size=2, seed=0, episode_index=0, evaluation=False)
    # once the schedule has reached 0 a small (even empty) pool is fine
    assert sample_demos(schedule, step=10, pool_size=0, seed=0, episode_index=0, evaluation=False) == []


def test_cosine_count_is_exact_at_integer_points():
    # 6 * (1 + cos(pi/2)) / 2 = 3 up to float error: must be 3, not 4
    assert demo_count(5, start=6, steps=10, kind="cosine") == 3
    assert math.isclose(demo_probability(5, steps=10, kind="cosine"), 0.5)
