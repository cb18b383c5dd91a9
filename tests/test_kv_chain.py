"""The kv_chain environment: chains, distractors, splits, the lookup tool, and a scripted episode."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.chat.toolcalls import format_tool_call, parse_assistant
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs import EnvError, assert_env_ok, get_env_class, list_envs
from ctxrl.envs.kv_chain import KVChainEnv
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.types import Message


def test_conformance_and_registry():
    assert_env_ok(KVChainEnv, n_tasks=16)
    assert "kv_chain" in list_envs() and get_env_class("kv_chain") is KVChainEnv


@pytest.mark.parametrize("split,lo,hi", [("train", 2, 4), ("heldout", 2, 4), ("ood", 6, 8)])
def test_chains_follow_the_context(split, lo, hi):
    for task in KVChainEnv.sample_tasks(split, 30, seed=3):
        store, chain = task.data["store"], task.data["chain"]
        assert lo <= task.context["hops"] == len(chain) <= hi
        assert len(store) == len(chain) + task.context["distractors"]
        assert chain[0] in task.prompt
        # walking the store from the start key visits the chain and ends at the answer
        key, seen = chain[0], []
        while store[key].startswith("next "):
            seen.append(key)
            key = store[key].split()[1]
        assert seen + [key] == chain and store[key] == f"value {task.answer}"
        # no distractor holds the right value
        others = [k for k in store if k not in chain]
        assert all(store[k] != f"value {task.answer}" for k in others)


def test_lookup_tool_and_errors():
    env = KVChainEnv()
    task = KVChainEnv.sample_tasks("train", 1, seed=0)[0]
    env.reset(task)
    call = parse_assistant(format_tool_call("lookup", {"key": task.data["chain"][0]}) + "\n" +
                           format_tool_call("lookup", {"key": "K0000"}))
    result = asyncio.run(env.step(call))
    assert not result.terminated and result.reward == 0.0
    assert result.messages[0].content == task.data["store"][task.data["chain"][0]]
    assert result.messages[1].content.startswith("Error") and "unknown key 'K0000'" in result.messages[1].content
    assert result.info["tool_calls"] == 2 and result.info["tool_errors"] == 1
    wrong = asyncio.run(env.step(Message(role="assistant", content="<answer>0</answer>")))
    assert wrong.terminated and wrong.reward == 0.0 and wrong.info == {"answered": True, "correct": False}
    with pytest.raises(EnvError, match="after the episode terminated"):
        asyncio.run(env.step(Message(role="assistant", content="<answer>0</answer>")))
    env.close()
    with pytest.raises(EnvError, match="lacks data"):
        env.reset(type(task)(id="x", prompt="p", answer="1"))


def test_scripted_episode_through_the_agent_loop(renderer):
    task = KVChainEnv.sample_tasks("ood", 1, seed=5)[0]
    texts = KVChainEnv.solve(task)
    hops = task.context["hops"]
    limits = RolloutLimits(max_turns=hops + 1, max_new_tokens=64, max_total_tokens=4096)
    episode = asyncio.run(run_episode(KVChainEnv(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))
    assert episode.success and episode.reward == 1.0 and episode.truncation is None
    assert episode.tool_calls == hops and len(episode.turns) == hops + 1
    # too few turns: the chain is not finished, the episode is cut at max_turns
    short = RolloutLimits(max_turns=hops, max_new_tokens=64, max_total_tokens=4096)
    cut = asyncio.run(run_episode(KVChainEnv(), task, ScriptedEngine(texts, renderer), renderer, short, seed=0))
    assert cut.truncation == "max_turns" and not cut.success
