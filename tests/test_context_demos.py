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
