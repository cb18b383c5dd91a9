"""Coding agents written against the Anthropic SDK (Messages) and OpenAI's Responses API, trained on ``repo_tasks``
through ``ctxrl serve`` (``examples/harness/repo_agents.py``).

Given the same scripted policy, each agent's recorded episode is the built-in ``repo_tasks`` episode id for id
(every prompt the engine saw, the ids, masks, log-probs and the reward): the two protocols add nothing and
re-tokenise nothing. A training step on each example config runs under ``-m slow``."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest

from ctxrl.config import load_config
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.repo_tasks import RepoTasksEnv
from ctxrl.rollout.agent import run_episodes
from ctxrl.rollout.spec import RolloutSpec
from ctxrl.rollout.worker import spec_env_class

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("anthropic")

AGENTS = "examples/harness/repo_agents.py"


def harness_class(agent: str) -> type:
    config = load_config(None, ["env.name=harness", f'env.harness.agent="{AGENTS}:{agent}"',
                                'env.data="env:repo_tasks"'])
    return spec_env_class(RolloutSpec.from_config(config))


@pytest.mark.parametrize("agent", ["anthropic_agent", "responses_agent"])
def test_an_sdk_agent_records_the_built_in_episode_id_for_id(agent, renderer, monkeypatch):
    from ctxrl.serve.harness import run_harness
    from ctxrl.tools import shell

    timed = shell.format_run  # (unittest says how long the tests took: the one thing two runs do not share)
    monkeypatch.setattr(shell, "format_run", lambda result: re.sub(r" in \d+\.\d+s", " in 0.000s", timed(result)))

    task = RepoTasksEnv.sample_tasks("train", 1, seed=4)[0]
    texts = RepoTasksEnv.solve(task)  # read, patch, run the tests, stop
    spec = RolloutSpec.from_config(load_config(None, []))
    lim = dataclasses.replace(spec.train, temperature=1.0, max_turns=6, max_new_tokens=512, max_total_tokens=4096)
    builtin_engine, harness_engine = ScriptedEngine(texts, renderer), ScriptedEngine(texts, renderer)
    [builtin] = asyncio.run(run_episodes(RepoTasksEnv, [task], builtin_engine, renderer, lim, seed=5))
    [recorded] = asyncio.run(run_harness(harness_class(agent), [task], harness_engine, renderer, lim, seed=5))
    assert builtin.reward == 1.0 and len(builtin.turns) == 4
    assert harness_engine.prompts == builtin_engine.prompts  # every call's prompt, id for id
    assert recorded.input_ids == builtin.input_ids and recorded.loss_mask == builtin.loss_mask
    assert recorded.behavior_logprobs == builtin.behavior_logprobs and recorded.turn_index == builtin.turn_index
    assert recorded.segments == [] and recorded.reward == 1.0 and recorded.success
    assert recorded.info["tool_calls"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("config", ["examples/harness/repo_anthropic.toml", "examples/harness/repo_responses.toml"])
def test_the_example_configs_train_a_step(config, tmp_path):
    from conftest import TINY

    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step

    cfg = load_config(config, [f"model.name={TINY}", "sft.enabled=false", "rollout.tasks_per_step=2",
                               "rollout.group_size=2", "rollout.max_new_tokens=16", "run.progress=false"])
    run = build(cfg, tmp_path)
    start_learning(run)
    row = rl_step(run, 0)
    assert row["skipped"] == 0.0 and row["errored"] == 0.0 and row["sampled_tokens"] > 0
