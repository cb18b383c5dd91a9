"""python_math: problems, mathematical answer checking (never executing model text), sandboxed episodes."""

from __future__ import annotations

import asyncio
import math

import pytest

from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs import assert_env_ok, get_env_class
from ctxrl.envs.python_math import FAMILIES, PythonMathEnv, _fib_mod, answers_equivalent
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.spec import RolloutLimits


def test_conformance_and_registry():
    assert_env_ok(PythonMathEnv, n_tasks=6)  # the gold code runs in the sandbox on every split
    assert get_env_class("python_math") is PythonMathEnv


@pytest.mark.parametrize("given,gold,same", [
    ("1234", "1234", True), ("1,234", "1234", True), ("1234.0", "1234", True), (r"\boxed{1234}", "1234", True),
    ("$1234$", "1234", True), ("2468/2", "1234", True), ("2^10", "1024", True), ("2**10", "1024", True),
    ("sqrt(16)", "4", True), ("0.5", "1/2", True), ("1235", "1234", False), ("", "1", False),
    ("import os", "1", False), ('__import__("os").system("x")', "0", False), ("9^9^9", "1", False),
    ("2^99999", "1", False), ("x + 1", "1", False), ("1/0", "1", False),
])
def test_answers_are_compared_as_numbers(given, gold, same):
    assert answers_equivalent(given, gold) is same


def test_problems_by_hand():
    assert _fib_mod(10, 1000) == 55 and _fib_mod(100, 997) == 354224848179261915075 % 997
    for task in PythonMathEnv.sample_tasks("train", 40, seed=1):
        assert task.context["family"] in FAMILIES and 1 <= task.context["scale"] <= 3
        if task.context["family"] == "sum_squares":
            n = int(task.prompt.split("1 to ")[1].rstrip("?"))
            assert int(task.answer) == sum(i * i for i in range(1, n + 1))
        if task.context["family"] == "factorial_digit_sum":
            n = int(task.prompt.split("digits of ")[1].split("!")[0])
            assert int(task.answer) == sum(map(int, str(math.factorial(n))))
    assert all(t.context["scale"] >= 4 for t in PythonMathEnv.sample_tasks("ood", 10, seed=1))


def test_episode_runs_the_code_in_the_sandbox(renderer):
    task = next(t for t in PythonMathEnv.sample_tasks("heldout", 20, seed=2) if t.context["family"] == "count_primes")
    limits = RolloutLimits(max_turns=3, max_new_tokens=256, max_total_tokens=4096)
    episode = asyncio.run(run_episode(PythonMathEnv(), task, ScriptedEngine(PythonMathEnv.solve(task), renderer),
                                      renderer, limits, seed=0))
    assert episode.success and episode.tool_calls == 1 and episode.tool_errors == 0
    # the observation the model saw is the sandbox's printed output
    assert episode.messages[3].content == task.answer
    # a crashing program is an observation too, and a wrong answer earns nothing
    texts = ['<tool_call>\n{"name": "python", "arguments": {"code": "print(1/0)"}}\n</tool_call>', "<answer>7</answer>"]
    bad = asyncio.run(run_episode(PythonMathEnv(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))
    assert "ZeroDivisionError" in bad.messages[3].content and bad.reward == 0.0 and not bad.success


def test_shortcut_and_replayed_pretraining_variant(renderer):
    """The shortcut answers without the tool; the pre-training variant replays exactly the sandbox's output."""
    from ctxrl.envs.python_math import ReplayedPythonMathEnv

    assert PythonMathEnv.pretraining_variant(3) is ReplayedPythonMathEnv
    limits = RolloutLimits(max_turns=3, max_new_tokens=256, max_total_tokens=4096)
    tasks = PythonMathEnv.sample_tasks("train", 40, seed=4)
    for family in FAMILIES:
        task = next(t for t in tasks if t.context["family"] == family)
        assert PythonMathEnv.shortcut(task) == [f"<answer>{task.answer}</answer>"]
        runs = [asyncio.run(run_episode(cls(), task, ScriptedEngine(PythonMathEnv.solve(task), renderer), renderer,
                                        limits, seed=0)) for cls in (PythonMathEnv, ReplayedPythonMathEnv)]
        assert runs[0].input_ids == runs[1].input_ids and runs[0].success and runs[1].success
    # code other than the reference still runs (in the sandbox)
    texts = ['<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>',
             "<answer>42</answer>"]
    episode = asyncio.run(run_episode(ReplayedPythonMathEnv(), tasks[0], ScriptedEngine(texts, renderer), renderer,
                                      limits, seed=0))
    assert episode.messages[3].content == "42"


def test_redundant_script_runs_the_code_twice_and_is_right(renderer):
    """The over-calling demo: the same call twice, the same answer, one tool call more than ``solve``."""
    from ctxrl.envs.python_math import ReplayedPythonMathEnv

    limits = RolloutLimits(max_turns=4, max_new_tokens=256, max_total_tokens=4096)
    task = PythonMathEnv.sample_tasks("train", 5, seed=4)[0]
    texts = PythonMathEnv.redundant(task)
    assert texts == [PythonMathEnv.solve(task)[0], *PythonMathEnv.solve(task)]
    episode = asyncio.run(run_episode(ReplayedPythonMathEnv(), task, ScriptedEngine(texts, renderer), renderer,
                                      limits, seed=0))
    assert episode.success and episode.tool_calls == 2
    assert episode.messages[3].content == episode.messages[5].content == task.answer
