"""What a context rewrite keeps of the facts the answer needs (``ctxrl.rollout.managers.facts``), measured on scripted
play, and the per-task outcomes an evaluation logs for statistics over tasks (issue 49)."""

from __future__ import annotations

import asyncio

from ctxrl.rollout.managers.facts import answer_facts, contains, facts_at_answer, survival, survival_rate
from ctxrl.types import Episode, Message, Task


def test_a_fact_is_a_whole_word_and_the_prompts_own_words_are_not_facts():
    assert contains("code 731\nnext P4821", "731") and not contains("code 7310", "731")
    assert not contains("x731", "731") and contains("Works at VOSS.", "voss")
    assert answer_facts("731 482") == ["731", "482"]
    assert answer_facts("Voss Brin Voss") == ["Voss", "Brin"]  # distinct
    assert answer_facts("Paris 12", prompt="Is it Paris?") == ["12"]  # shown by the task: kept by every restart


def test_survival_counts_only_facts_seen_before_the_rewrite():
    facts = ["731", "482"]
    before = [Message("user", "task"), Message("tool", "code 731\nnext P2")]
    assert survival(facts, before, [Message("user", "Pages read: 1. First code: 731.")]) == (1, 1)
    assert survival(facts, before, [Message("user", "Pages read: 1. Next page: P2.")]) == (0, 1)
    assert survival(facts, [Message("user", "task")], [Message("user", "anything")]) == (0, 0)


def _episode(pairs):
    return Episode(task=Task(id="t", prompt="p", answer="1 2"), info={"fact_survival": pairs})


def test_survival_rate_is_facts_kept_over_facts_seen_across_rewrites():
    rate, scored = survival_rate([_episode([[1, 1], [0, 0]]), _episode([[1, 2]]), _episode([])])
    assert (rate, scored) == (2 / 3, 2)
    rate, scored = survival_rate([_episode([])])
    assert rate != rate and scored == 0  # NaN: nothing to score


def _play(renderer, manager: str, budget: int, n: int = 12):
    from ctxrl.demos.play import DEMO_MAX_TURNS, build_demos
    from ctxrl.envs.fact_hunt import FactHuntEnv
    from ctxrl.rollout.managers import ContextPolicy
    from ctxrl.rollout.spec import RolloutLimits

    limits = RolloutLimits(max_turns=DEMO_MAX_TURNS, max_new_tokens=32, max_total_tokens=4096,
                           context=ContextPolicy(manager=manager, max_context_tokens=budget,
                                                 options={"max_summaries": 8}))
    return asyncio.run(build_demos(FactHuntEnv, renderer, n, seed=3, limits=limits))


def test_scripted_summaries_keep_every_fact_a_window_loses_the_first_code(renderer):
    from ctxrl.rollout.managers.stats import context_stats

    summarized = _play(renderer, "summarize", 400)
    stats = context_stats(summarized)
    assert stats["fact_survival_rewrites"] > 0 and stats["fact_survival"] == 1.0  # the env's template carries both
    windowed = asyncio.run(_window(renderer))
    cut = [e for e in windowed if e.info.get("windows")]
    assert cut and all(e.info["fact_survival"][0] == [0, 1] for e in cut)  # the first code, dropped
    assert context_stats(windowed)["fact_survival"] < 1.0  # (a later window keeps the newest page's last code)
    # at the answer: the summaries carried both codes; a window holds the last code and never the first
    assert context_stats(summarized)["facts_at_answer"] == 1.0
    assert {facts_at_answer(e) for e in cut} == {0.5} and context_stats(windowed)["facts_at_answer_episodes"] > 0


async def _window(renderer):
    """Scripted solutions under ``window`` (no scripted hook: the plain solve script), which drops the first page."""
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.envs.fact_hunt import FactHuntEnv
    from ctxrl.rollout.agent import run_episode
    from ctxrl.rollout.managers import ContextPolicy
    from ctxrl.rollout.spec import RolloutLimits

    limits = RolloutLimits(max_turns=8, max_new_tokens=32, max_total_tokens=4096,
                           context=ContextPolicy(manager="window", max_context_tokens=340))
    tasks = [t for t in FactHuntEnv.sample_tasks("train", 16, 5) if len(t.data["trail"]) >= 3]
    return await asyncio.gather(*(run_episode(FactHuntEnv(), t, ScriptedEngine(FactHuntEnv.solve(t), renderer),
                                              renderer, limits, seed=0) for t in tasks))


def test_task_outcomes_give_each_tasks_success_by_attempt_and_survival():
    from ctxrl.eval.evaluate import task_outcomes

    def ep(task, success, **info):
        return Episode(task=Task(id=task, prompt="p", answer="a"), success=success, info=info)

    plain = task_outcomes([ep("a", True), ep("a", False), ep("b", True, fact_survival=[[1, 2]])])
    assert plain == {"task_success": {"a": 0.5, "b": 1.0}, "task_fact_survival": {"b": 0.5}}
    trials = [ep("a", True, num_attempts=3, attempts=[{"success": False}, {"success": True}]),
              ep("b", False, num_attempts=3, attempts=[{"success": False}] * 3),
              ep("c", True, num_attempts=3, attempts=[{"success": True}])]
    out = task_outcomes(trials)
    assert out["task_success_by_attempt"] == {"a": [0.0, 1.0, 1.0], "b": [0.0, 0.0, 0.0], "c": [1.0, 1.0, 1.0]}
    assert out["task_success"] == {"a": 0.0, "b": 0.0, "c": 1.0}  # attempt 1, as the row's success
    errored = Episode(task=Task(id="e", prompt="p", answer="a"), success=True, truncation="error")
    assert task_outcomes([errored])["task_success"] == {"e": 0.0}


def test_the_scripted_ceiling_says_when_a_baseline_cannot_win_by_construction(renderer):
    from ctxrl.demos.ceiling import scripted_ceiling
    from ctxrl.envs.fact_hunt import FactHuntEnv
    from ctxrl.rollout.managers import ContextPolicy
    from ctxrl.rollout.spec import RolloutLimits

    def ceiling(manager: str, budget: int = 0) -> dict:
        limits = RolloutLimits(max_turns=8, max_new_tokens=32, max_total_tokens=4096,
                               context=ContextPolicy(manager=manager, max_context_tokens=budget,
                                                     options={"max_summaries": 8}))
        return scripted_ceiling(FactHuntEnv, renderer, limits, 12, seed=1)

    full, summarize, window = ceiling("full"), ceiling("summarize", 400), ceiling("window", 340)
    assert full["ceiling"] == 1.0 and full["cut_short"] == 0.0
    assert summarize["ceiling"] == 1.0 and summarize["peak_context_max"] > 400  # the summary step passes the budget
    assert window["ceiling"] == 0.0  # opening + one page: the first code is gone by the answer, on every trail
    assert window["peak_context_max"] <= 340 < full["peak_context_max"]
    wide = ceiling("window", full["peak_context_max"] + 32)
    assert wide["ceiling"] == 1.0  # a window as wide as the longest episode is the full context


def test_a_task_without_answer_facts_is_reachable_when_its_scripted_play_succeeds(renderer):
    """hidden_word's answer is guessed, not read: no facts to keep, so its ceiling is the script's success (it was
    0.00, and the plan checker refused every meta-RL comparison on it)."""
    from ctxrl.demos.ceiling import scripted_ceiling
    from ctxrl.envs.hidden_word import HiddenWordEnv
    from ctxrl.rollout.managers import ContextPolicy
    from ctxrl.rollout.spec import RolloutLimits

    limits = RolloutLimits(max_turns=5, max_new_tokens=32, max_total_tokens=1536,
                           context=ContextPolicy(manager="full", max_context_tokens=0, options={}))
    result = scripted_ceiling(HiddenWordEnv, renderer, limits, 8, seed=1)
    assert result["ceiling"] == 1.0 and result["cut_short"] == 0.0
