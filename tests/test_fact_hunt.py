"""The fact_hunt environment: trails, distinct numbers, the answer from the first and last pages, the read tool,
summaries that carry the first code, and a scripted episode; the property it exists for: the first code is seen
once, in the first observation, so a context that keeps only the newest turns cannot hold it."""

from __future__ import annotations

import asyncio
import re

import pytest

from ctxrl.chat.toolcalls import format_tool_call, parse_assistant
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs import EnvError, assert_env_ok, get_env_class, list_envs
from ctxrl.envs.fact_hunt import FactHuntEnv
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.types import Message


def test_conformance_and_registry():
    assert_env_ok(FactHuntEnv, n_tasks=16)
    assert "fact_hunt" in list_envs() and get_env_class("fact_hunt") is FactHuntEnv


@pytest.mark.parametrize("split,lo,hi", [("train", 2, 4), ("heldout", 2, 4), ("ood", 6, 8)])
def test_trails_follow_the_context_and_the_answer_is_the_first_and_last_codes(split, lo, hi):
    for task in FactHuntEnv.sample_tasks(split, 30, seed=3):
        pages, trail, codes = task.data["pages"], task.data["trail"], task.data["codes"]
        assert lo <= task.context["pages"] == len(trail) == len(pages) <= hi
        assert trail[0] in task.prompt
        numbers = [int(x) for text in pages.values() for x in re.findall(r"\b\d{3}\b", text)]
        assert len(numbers) == len(set(numbers)) == len(trail) * (1 + task.context["distractors"])  # all distinct
        for i, page in enumerate(trail):
            lines = pages[page].splitlines()
            assert [line for line in lines if line.startswith("code ")] == [f"code {codes[i]}"]
            assert sum(line.startswith("other ") for line in lines) == task.context["distractors"]
            assert lines[-1] == (f"next {trail[i + 1]}" if i + 1 < len(trail) else "end")
        assert task.answer == f"{codes[0]} {codes[-1]}"


def test_the_first_code_is_seen_only_in_the_first_observation():
    """Why window fails by construction: nothing after the first read, nor the prompt, holds the first code, and the
    answer needs it (every number of a task is distinct)."""
    for task in FactHuntEnv.sample_tasks("train", 50, seed=7) + FactHuntEnv.sample_tasks("ood", 20, seed=7):
        first = re.compile(rf"\b{task.data['codes'][0]}\b")  # (as a number, not inside a page name)
        later = [task.data["pages"][p] for p in task.data["trail"][1:]]
        assert not first.search(task.prompt) and not any(first.search(text) for text in later)
        assert first.search(task.data["pages"][task.data["trail"][0]])


def test_read_tool_and_errors():
    env = FactHuntEnv()
    task = FactHuntEnv.sample_tasks("train", 1, seed=0)[0]
    env.reset(task)
    call = parse_assistant(format_tool_call("read", {"page": task.data["trail"][0]}) + "\n" +
                           format_tool_call("read", {"page": "P0000"}))
    result = asyncio.run(env.step(call))
    assert not result.terminated and result.reward == 0.0
    assert result.messages[0].content == task.data["pages"][task.data["trail"][0]]
    assert result.messages[1].content.startswith("Error") and "unknown page 'P0000'" in result.messages[1].content
    wrong = asyncio.run(env.step(Message(role="assistant", content="<answer>0</answer>")))
    assert wrong.terminated and wrong.reward == 0.0
    first, last = task.answer.split()
    for given, right in [(f"{first}, {last}", True), (f"first {first} last {last}", True), (f"{last} {first}", False),
                         (first, False), (f"{first} {last} 7", False)]:
        assert env.check_answer(given, task)[0] is right, given
    env.close()
    with pytest.raises(EnvError, match="lacks data"):
        env.reset(type(task)(id="x", prompt="p", answer="1"))


def _reads(task, pages):
    return [Message(role="tool", name="read", content=task.data["pages"][p]) for p in pages]


def test_summaries_carry_the_first_code_through_restarts_to_the_answer():
    task = next(t for t in FactHuntEnv.sample_tasks("ood", 10, seed=1) if t.context["pages"] >= 6)
    trail, codes = task.data["trail"], task.data["codes"]
    assert FactHuntEnv.summary(task, []) == f"No pages read yet. Next page: {trail[0]}."
    first = FactHuntEnv.summary(task, _reads(task, trail[:2]))
    assert first == f"Pages read: 2. First code: {codes[0]}. Next page: {trail[2]}."
    # a restarted context: the task with the summary, then more reads (the first page is no longer visible)
    restarted = [Message(role="user", content=f"{task.prompt}\n\nSummary so far:\n{first}")]
    second = FactHuntEnv.summary(task, restarted + _reads(task, trail[2:4]))
    assert second == f"Pages read: 4. First code: {codes[0]}. Next page: {trail[4]}."
    assert FactHuntEnv.summary(task, [Message(role="user", content=second)]) == second  # nothing new read
    final = FactHuntEnv.summary(task, [Message(role="user", content=second)] + _reads(task, trail[4:]))
    assert final == f"Pages read: {len(trail)}. First code: {codes[0]}. Last code: {codes[-1]}."
    assert FactHuntEnv.summary(task, [Message(role="user", content=final)]) == final  # summarised again: kept
    found = dict(re.findall(r"(First|Last) code: (\d+)", final))
    assert f"{found['First']} {found['Last']}" == task.answer  # the final summary alone answers it


def test_scripted_episode_through_the_agent_loop(renderer):
    task = FactHuntEnv.sample_tasks("ood", 1, seed=5)[0]
    texts = FactHuntEnv.solve(task)
    pages = task.context["pages"]
    limits = RolloutLimits(max_turns=pages + 1, max_new_tokens=64, max_total_tokens=4096)
    episode = asyncio.run(run_episode(FactHuntEnv(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))
    assert episode.success and episode.reward == 1.0 and episode.tool_calls == pages
