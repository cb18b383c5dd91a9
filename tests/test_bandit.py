"""The bandit environment: arms and colours, deterministic pseudo-regret reward, wasted pulls, splits."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.chat.toolcalls import format_tool_call, parse_assistant
from ctxrl.envs import EnvError, assert_env_ok, get_env_class
from ctxrl.envs.bandit import COLOURS, BanditEnv
from ctxrl.types import Message


def _pull(arm) -> Message:
    return parse_assistant(format_tool_call("pull", {"arm": arm}))


def _play(task, arms: list, seed: int = 0):
    env = BanditEnv()
    env.reset(task, seed=seed)
    results = [asyncio.run(env.step(_pull(a) if a is not None else Message(role="assistant", content="?")))
               for a in arms]
    env.close()
    return results


def test_conformance_and_registry():
    assert_env_ok(BanditEnv, n_tasks=16)
    assert get_env_class("bandit") is BanditEnv


@pytest.mark.parametrize("split,arms,horizon", [("train", (2, 4), (4, 8)), ("ood", (5, 6), (12, 16))])
def test_tasks_follow_the_context(split, arms, horizon):
    for task in BanditEnv.sample_tasks(split, 30, seed=4):
        c, probs = task.context, task.data["probs"]
        assert arms[0] <= c["arms"] <= arms[1] and horizon[0] <= c["horizon"] <= horizon[1]
        assert len(probs) == (2 if c["contextual"] else 1) and all(len(row) == c["arms"] for row in probs)
        bests = [max(range(c["arms"]), key=row.__getitem__) for row in probs]
        assert task.answer == ",".join(map(str, bests))
        assert len(set(bests)) == len(bests)  # the colour matters in the contextual variant
        for row, best in zip(probs, bests):
            assert all(row[best] - p >= c["gap"] - 1e-9 for a, p in enumerate(row) if a != best)
        assert len(task.data["colours"]) == (c["horizon"] if c["contextual"] else 0)


def test_reward_is_one_minus_normalised_pseudo_regret():
    task = next(t for t in BanditEnv.sample_tasks("train", 50, 1) if not t.context["contextual"])
    row, horizon = task.data["probs"][0], task.context["horizon"]
    best = max(range(len(row)), key=row.__getitem__)
    worst = min(range(len(row)), key=row.__getitem__)
    mean = sum(row) / len(row)
    oracle = _play(task, [best] * horizon)
    assert oracle[-1].terminated and oracle[-1].reward == pytest.approx(1.0) and oracle[-1].info["regret"] == 0
    assert all(not r.terminated and r.reward == 0.0 for r in oracle[:-1])
    # one bad pull, then the best arm: regret (best - worst) over a scale of horizon * (best - mean)
    one_bad = _play(task, [worst] + [best] * (horizon - 1))[-1]
    assert one_bad.reward == pytest.approx(1 - (row[best] - row[worst]) / (horizon * (row[best] - mean)))
    assert one_bad.info["best_arm_rate"] == pytest.approx((horizon - 1) / horizon)
    # a turn without a pull wastes it: regret p_best; bad arms raise an Error observation, also wasted
    wasted = _play(task, [None, len(row) + 3] + [best] * (horizon - 2))
    assert wasted[0].messages[0].content.startswith("Error: no pull")
    assert wasted[1].messages[0].content.startswith("Error") and wasted[1].info["tool_errors"] == 1
    assert wasted[-1].reward == pytest.approx(max(-1.0, 1 - 2 * row[best] / (horizon * (row[best] - mean))))
    assert wasted[-1].info["pulls"] == horizon


def test_sampled_rewards_follow_the_seed_and_colours_are_shown():
    task = next(t for t in BanditEnv.sample_tasks("train", 50, 2) if t.context["contextual"])
    env = BanditEnv()
    first = env.reset(task, seed=7)
    assert first[1].content.endswith(f"Colour: {task.data['colours'][0]}")
    a = [r.messages[0].content for r in _play(task, [0] * task.context["horizon"], seed=7)]
    b = [r.messages[0].content for r in _play(task, [0] * task.context["horizon"], seed=7)]
    assert a == b and a[0].startswith("reward ") and f"Colour: {task.data['colours'][1]}" in a[0]
    assert all(c in COLOURS for c in task.data["colours"])
    done = _play(task, [0] * task.context["horizon"])
    with pytest.raises(EnvError):
        env.reset(type(task)(id="x", prompt="p", answer="0"))
    assert done[-1].terminated


def test_pulls_are_actions_and_pulls_of_a_worse_arm_failed():
    plain = next(t for t in BanditEnv.sample_tasks("train", 50, 1) if not t.context["contextual"])
    row = plain.data["probs"][0]
    best = max(range(len(row)), key=row.__getitem__)
    worst = min(range(len(row)), key=row.__getitem__)
    steps = _play(plain, [best, worst, None] + [best] * (plain.context["horizon"] - 3))
    assert steps[0].info["actions"] == [f"pull {best}"] and steps[0].info["failed_actions"] == []
    assert steps[1].info["actions"] == [f"pull {worst}"] and steps[1].info["failed_actions"] == [f"pull {worst}"]
    assert "actions" not in steps[2].info  # no pull, no action
    coloured = next(t for t in BanditEnv.sample_tasks("train", 50, 2) if t.context["contextual"])
    first = _play(coloured, [0] * coloured.context["horizon"])[0]
    assert first.info["actions"] == [f"pull 0 on {coloured.data['colours'][0]}"]
