"""A reward the learner's float32 cannot carry (1e308 is finite in float64, infinite in float32; NaN) errors its
episode instead of turning the whole batch's losses into NaN (issue 51)."""

from __future__ import annotations

import asyncio
import math

import pytest

from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.types import MAX_ABS_REWARD


@pytest.mark.parametrize("reward", [1e308, -1e308, math.inf, math.nan, MAX_ABS_REWARD * 2])
def test_an_environment_reward_past_the_limit_errors_its_episode(reward, renderer):
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.rollout.agent import run_episodes
    from ctxrl.rollout.spec import RolloutLimits

    class Overflowing(CalculatorEnv):
        async def step(self, message):
            result = await super().step(message)
            result.reward = reward
            return result

    tasks = CalculatorEnv.sample_tasks("train", 2, 0)
    engine = ScriptedEngine(["<answer>1</answer>"] * 4, renderer)  # (one turn an episode)
    episodes = asyncio.run(run_episodes(Overflowing, tasks, engine, renderer, RolloutLimits(timeout_s=5),
                                        group_size=2))
    assert len(episodes) == 4 and all(e.truncation == "error" and e.info["error_kind"] == "step" for e in episodes)
    assert all("scale its rewards" in e.info["error"] for e in episodes)


def test_a_reward_within_the_limit_is_kept(renderer):
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.rollout.agent import run_episodes
    from ctxrl.rollout.spec import RolloutLimits

    class Large(CalculatorEnv):
        async def step(self, message):
            result = await super().step(message)
            result.reward = -MAX_ABS_REWARD
            return result

    tasks = CalculatorEnv.sample_tasks("train", 1, 0)
    engine = ScriptedEngine(["<answer>1</answer>"], renderer)
    episodes = asyncio.run(run_episodes(Large, tasks, engine, renderer, RolloutLimits(timeout_s=5), group_size=1))
    assert episodes[0].truncation is None and episodes[0].reward == -MAX_ABS_REWARD
