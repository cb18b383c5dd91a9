"""Warm-start demos under the summarize manager: scripted summaries, token-faithful segments, config."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.engine.base import SamplingParams
from ctxrl.rollout.scripted import ScriptedEngine


def test_scripted_engine_answers_a_summary_request_without_using_up_a_turn(renderer):
    engine = ScriptedEngine(["first", "second"], renderer, summary=lambda: "the summary")
    turn, summary = SamplingParams(max_new_tokens=64), SamplingParams(max_new_tokens=64, purpose="summary")
    out = [asyncio.run(engine.generate([1], p)) for p in (turn, summary, turn)]
    assert [renderer.decode(c.token_ids[:-1]) for c in out] == ["first", "the summary", "second"]
    assert all(c.finish_reason == "stop" and not any(c.logprobs) for c in out)
    assert engine.summaries == ["the summary"] and len(engine.prompts) == 3
    with pytest.raises(RuntimeError, match="no summary script"):
        asyncio.run(ScriptedEngine(["first"], renderer).generate([1], summary))
    with pytest.raises(ValueError, match="purpose must be one of turn, summary"):
        SamplingParams(purpose="sumary")


def test_kv_chain_summary_holds_the_lookups_done_and_where_the_chain_stands():
    from ctxrl.envs.kv_chain import KVChainEnv
    from ctxrl.types import Message, Task

    task = Task(id="t", prompt="Start at key K1000 ...", answer="731", data={"chain": ["K1000", "K2000"]})
    opening = [Message("system", "s"), Message("user", task.prompt)]
    assert KVChainEnv.summary(task, opening) == "No lookups yet. Next key: K1000."
    seen = [*opening, Message("assistant", "call"), Message("tool", "next K2000", name="lookup"),
            Message("assistant", "bad call"), Message("tool", "Error: tool lookup raised KeyError", name="lookup")]
    assert KVChainEnv.summary(task, seen) == "Lookups done: 1. Next key: K2000."  # an error is not a lookup
    done = [*seen, Message("assistant", "call"), Message("tool", "value 731", name="lookup")]
    assert KVChainEnv.summary(task, done) == "Lookups done: 2. The chain ended with value 731."


def test_search_qa_summary_holds_the_latest_fact_on_the_questions_path():
    from ctxrl.envs.search_qa import SearchQAEnv
    from ctxrl.types import Message, Task, ToolCall

    task = Task(id="t", prompt="In which city is the company that Alda Morvi works for headquartered?",
                answer="Keltra", data={"lookups": ["Alda Morvi", "Brada Labs"]})

    def search(query: str, results: str) -> list[Message]:
        return [Message("assistant", "c", tool_calls=[ToolCall("search", {"query": query})]),
                Message("tool", results, name="search")]

    first = search("Alda Morvi", "[1] Brada Labs: Brada Labs is a company headquartered in Keltra.\n"
                                 "[2] Alda Morvi: Alda Morvi was born in Brada. Alda Morvi works for Brada Labs.")
    assert SearchQAEnv.summary(task, []) == "Nothing found yet."
    # the searched entity's sentence that names the next entity on the path (not the one about "Brada")
    assert SearchQAEnv.summary(task, first) == "Found: Alda Morvi works for Brada Labs."
    second = search("Brada Labs", "[1] Brada Labs: Brada Labs is a company headquartered in Keltra.")
    assert SearchQAEnv.summary(task, first + second) == "Found: Brada Labs is a company headquartered in Keltra."
    # a search whose results lack the searched title keeps the latest fact
    assert SearchQAEnv.summary(task, first + search("Keltra", "No results.")) == "Found: Alda Morvi works for Brada Labs."
