"""Warm-start demos under the summarize manager: scripted summaries, token-faithful segments, config."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.engine.base import SamplingParams
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.prompts import SUMMARY_INSTRUCTION


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
    unseen = search("Keltra", "No results.")
    assert SearchQAEnv.summary(task, first + unseen) == "Found: Alda Morvi works for Brada Labs."


def _summarize_limits(budget: int, max_summaries: int = 4, max_new_tokens: int = 48):
    from ctxrl.rollout.managers import ContextPolicy
    from ctxrl.rollout.spec import RolloutLimits

    return RolloutLimits(max_turns=16, max_new_tokens=max_new_tokens, max_total_tokens=2048,
                         context=ContextPolicy(manager="summarize", max_context_tokens=budget,
                                               options={"max_summaries": max_summaries, "max_tokens": 64}))


def _sampled_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of mask-1 tokens: one per generation."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _check_faithful(demo, env_cls, renderer, limits) -> list[str]:
    """Segment k ends with summary k as sampled tokens; segment k+1 starts from exactly system + task + it.

    Returns the summaries, oldest first.
    """
    from ctxrl.rollout.managers.summarize import restart_messages

    budget, max_new_tokens = limits.context.max_context_tokens, limits.max_new_tokens
    env = env_cls()
    opening, tools = env.reset(demo.task), [t.schema() for t in env.tools]
    sequences = demo.sequences()
    start = renderer.prompt_ids(opening, tools)
    assert sequences[0].input_ids[: len(start)] == start
    summaries = []
    for seg, nxt in zip(sequences, sequences[1:]):
        assert seg.ended_by == "summary" and seg.messages[-2].content == SUMMARY_INSTRUCTION
        summary = seg.messages[-1].content
        ids = renderer.assistant_ids(summary)
        assert seg.input_ids[-len(ids):] == ids  # the scripted summary, as if sampled: mask 1, log-prob 0
        assert all(seg.loss_mask[-len(ids):]) and not any(seg.behavior_logprobs[-len(ids):])
        restart = renderer.prompt_ids(restart_messages(opening, summary), tools)
        assert nxt.input_ids[: len(restart)] == restart and not any(nxt.loss_mask[: len(restart)])
        summaries.append(summary)
    for seq in sequences:  # every action turn was generated within the budget (the summary may pass it)
        runs = _sampled_runs(seq.loss_mask)
        turns = runs[:-1] if seq.ended_by == "summary" else runs
        assert turns and all(begin + max_new_tokens <= budget for begin, _ in turns)
    return summaries


def test_kv_chain_demos_under_summarize_are_faithful_and_the_next_lookup_follows_from_the_summary(renderer):
    import re

    from ctxrl.demos.play import build_demos
    from ctxrl.envs.kv_chain import KVChainEnv

    demos = asyncio.run(build_demos(KVChainEnv, renderer, 40, seed=1, limits=_summarize_limits(384)))
    assert all(d.success and d.reward == 1.0 and d.truncation is None for d in demos)  # the solver still scores 1.0
    summarised = [d for d in demos if d.info.get("summaries")]
    assert len(summarised) >= 10
    assert sum(len(d.segments) for d in demos) == sum(d.info.get("summaries", 0) for d in demos)
    for demo in summarised:
        summaries = _check_faithful(demo, KVChainEnv, renderer, _summarize_limits(384))
        for summary, seg, nxt in zip(summaries, demo.sequences(), demo.sequences()[1:]):
            last = [m.content for m in seg.messages if m.role == "tool"][-1]  # the observation just before it
            first_turn = next(m for m in nxt.messages if m.role == "assistant")
            done = int(re.match(r"Lookups done: (\d+)\.", summary).group(1))
            if last.startswith("next "):
                key = last.split()[1]
                assert summary.endswith(f"Next key: {key}.") and first_turn.tool_calls[0].arguments == {"key": key}
                assert done == demo.task.data["chain"].index(key)
            else:
                assert summary.endswith(f"value {demo.task.answer}.")
                assert first_turn.content == f"<answer>{demo.task.answer}</answer>"
                assert done == len(demo.task.data["chain"])


def test_search_qa_demos_under_summarize_succeed_from_the_latest_fact(renderer):
    from ctxrl.demos.play import build_demos
    from ctxrl.envs.search_qa import SearchQAEnv

    demos = asyncio.run(build_demos(SearchQAEnv, renderer, 30, seed=2, limits=_summarize_limits(450),
                                    other_worlds=True))
    assert all(d.success and d.truncation is None for d in demos)
    summarised = [d for d in demos if d.info.get("summaries")]
    assert len(summarised) >= 5
    for demo in summarised:  # demos come from other worlds, whose opening and tools render the same
        summaries = _check_faithful(demo, SearchQAEnv, renderer, _summarize_limits(450))
        for summary, nxt in zip(summaries, demo.sequences()[1:]):
            first_turn = next(m for m in nxt.messages if m.role == "assistant")
            wanted = first_turn.tool_calls[0].arguments["query"] if first_turn.tool_calls else demo.task.answer
            assert summary.startswith("Found: ") and summary.rstrip(".").endswith(wanted)  # what comes next is in it


def test_an_env_without_the_hook_cannot_script_summaries(renderer):
    from ctxrl.demos.play import build_demos
    from ctxrl.envs.calculator import CalculatorEnv

    assert getattr(CalculatorEnv, "summary", None) is None
    with pytest.raises(ValueError, match="'calculator' has no summary\\(task, messages\\) hook.*sft.context_demos=off"):
        asyncio.run(build_demos(CalculatorEnv, renderer, 2, limits=_summarize_limits(384)))
    # without a summarize policy its demos are full-context, as always
    demos = asyncio.run(build_demos(CalculatorEnv, renderer, 2))
    assert all(d.success and not d.segments for d in demos)


def test_a_demo_that_cannot_finish_under_the_budget_names_the_settings(renderer):
    from ctxrl.demos.play import build_demos
    from ctxrl.envs.kv_chain import KVChainEnv

    with pytest.raises(RuntimeError, match="context.summarize.max_summaries=0.*raise one of them"):
        asyncio.run(build_demos(KVChainEnv, renderer, 20, seed=1, limits=_summarize_limits(384, max_summaries=0)))
    with pytest.raises(RuntimeError, match="longer than the room it gets"):
        asyncio.run(build_demos(KVChainEnv, renderer, 20, seed=1, limits=_summarize_limits(384, max_new_tokens=20)))


def _config(*overrides: str):
    from ctxrl.config import load_config

    return load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=kv_chain", "context.manager=summarize",
                              "context.max_context_tokens=384", "rollout.max_new_tokens=48",
                              "rollout.max_total_tokens=1024", "run.progress=false", *overrides])


def test_context_demos_config_is_checked():
    from ctxrl.config import ConfigError

    assert _config().sft.context_demos == "auto"
    with pytest.raises(ConfigError, match="sft.context_demos must be one of auto, on, off"):
        _config("sft.context_demos=yes")
    with pytest.raises(ConfigError, match="context.manager='window' asks for none"):
        _config("context.manager=window", "sft.context_demos=on")


def test_run_plays_its_warm_start_demos_under_summarize_when_the_env_can(tmp_path, renderer):
    import warnings

    from ctxrl.config import ConfigError
    from ctxrl.run import loop
    from ctxrl.run.build import build
    from ctxrl.train.warm_start import demo_limits

    run = build(_config("sft.demos=8", "sft.epochs=1", "sft.batch_size=4"), tmp_path / "kv")
    limits = demo_limits(run.spec, run.context_demos)
    assert run.context_demos and limits.context == run.spec.train.context  # the run's policy at its final budget
    assert limits.max_new_tokens == 48 and limits.max_total_tokens == 1024
    steps = []
    row = loop.warm_start(run, on_step=lambda step, total, loss: steps.append(total))
    assert row["context_demos"] and row["demo_summaries_per_episode"] > 0
    # every segment trains as its own sequence: more sequences than demos, batch_size sequences per step
    sequences = 8 + round(row["demo_summaries_per_episode"] * 8)
    assert row["sft_steps"] == steps[-1] == -(-sequences // 4)
    # off: full-context demos
    off = build(_config("sft.context_demos=off"), tmp_path / "off")
    assert not off.context_demos and demo_limits(off.spec, off.context_demos) is None
    # an env without the hook: auto says so once and plays full-context demos; on is a config error
    calc = build(_config("env.name=calculator", "sft.demos=4", "sft.epochs=1"), tmp_path / "calc")
    assert not calc.context_demos and demo_limits(calc.spec, calc.context_demos) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.warm_start(calc)
    assert any("no summary(task, messages) hook" in str(w.message) for w in caught)
    with pytest.raises(ConfigError, match="sft.context_demos=on, but environment 'calculator' has no summary"):
        build(_config("env.name=calculator", "sft.context_demos=on"), tmp_path / "on")
