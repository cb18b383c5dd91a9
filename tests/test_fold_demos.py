"""``fold`` at equal working-context budgets: branching warm-start demos (``folded``) and the optional budget."""

from __future__ import annotations

import asyncio
import random

import pytest

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.config import ConfigError, load_config
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.fact_hunt import FactHuntEnv
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.managers import ContextPolicy, get_manager
from ctxrl.rollout.managers.fold import FOLD_TOOL_SCHEMAS, branch_messages
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.types import Task


def _task(pages: int) -> Task:
    return next(t for t in FactHuntEnv.sample_tasks("train", 60, seed=3) if len(t.data["trail"]) == pages)


def _fold_limits(budget: int = 0, max_turns: int = 16, max_new_tokens: int = 80) -> RolloutLimits:
    return RolloutLimits(max_turns=max_turns, max_new_tokens=max_new_tokens, max_total_tokens=4096,
                         context=ContextPolicy(manager="fold", max_context_tokens=budget))


def _play(renderer, task: Task, texts: list[str], limits: RolloutLimits):
    return asyncio.run(run_episode(FactHuntEnv(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))


def test_folded_script_reads_page_one_then_branches_into_the_rest():
    task = _task(3)
    first, second, third = task.data["trail"]
    last = task.answer.split()[1]
    goal = f"Follow the trail from {second} to its last page; return the last code."
    assert FactHuntEnv.folded(task) == [
        format_tool_call("read", {"page": first}), format_tool_call("branch", {"goal": goal}),
        format_tool_call("read", {"page": second}), format_tool_call("read", {"page": third}),
        format_tool_call("return", {"result": last}), f"<answer>{task.answer}</answer>"]
    # a 1-page trail has nothing after page 1: no branch, the plain solution
    one = Task(id="one", prompt="p", answer="731 731", data={"trail": ["P1000"], "pages": {"P1000": "code 731\nend"}})
    assert FactHuntEnv.folded(one) == FactHuntEnv.solve(one)


@pytest.mark.parametrize("pages", [2, 3, 4])
def test_folded_demo_branches_once_and_the_parent_never_sees_the_later_pages(renderer, pages):
    task = _task(pages)
    texts = FactHuntEnv.folded(task)
    assert len(texts) == pages + 3  # read, branch, pages - 1 reads, return, answer
    episode = _play(renderer, task, texts, _fold_limits())
    assert episode.success and episode.reward == 1.0 and episode.truncation is None
    assert episode.info["branches"] == 1 and len(episode.turns) == pages + 3
    (branch,), parent = episode.segments, episode.sequences()[-1]
    assert branch.ended_by == "fold"
    env = FactHuntEnv()
    opening, tools = env.reset(task), [t.schema() for t in env.tools] + FOLD_TOOL_SCHEMAS
    # each segment starts from its own freshly rendered prompt, exactly (mask 0)
    start = renderer.prompt_ids(opening, tools)
    assert parent.input_ids[: len(start)] == start and not any(parent.loss_mask[: len(start)])
    goal = texts[1].split('"goal": "')[1].split('"')[0]
    branch_start = renderer.prompt_ids(branch_messages(opening, goal), tools)
    assert branch.input_ids[: len(branch_start)] == branch_start and not any(branch.loss_mask[: len(branch_start)])
    # the parent: page 1, the branch call, its result (the last code alone), the answer
    assert [m.role for m in parent.messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                 "assistant"]
    pages_of = task.data["pages"]
    trail = task.data["trail"]
    assert parent.messages[3].content == pages_of[trail[0]]
    assert parent.messages[5].content == task.answer.split()[1] and parent.messages[5].name == "branch"
    parent_text = renderer.decode(parent.input_ids)
    assert all(pages_of[p] not in parent_text for p in trail[1:])  # no later page's observation in the parent
    assert all(f'"page": "{p}"' not in parent_text for p in trail[1:])
    # the branch: the reads of pages 2..n and the return, nothing of page 1's observation
    assert [m.content for m in branch.messages if m.role == "tool"] == [pages_of[p] for p in trail[1:]]
    assert pages_of[trail[0]] not in renderer.decode(branch.input_ids)
    # token-faithful: every scripted turn is its assistant ids at mask 1 with log-prob 0, and is all that is mask 1
    for seq, turns in ((parent, [texts[0], texts[1], texts[-1]]), (branch, texts[2:-1])):
        assert len(seq.input_ids) == len(seq.loss_mask) == len(seq.behavior_logprobs)
        sampled = [t for t, m in zip(seq.input_ids, seq.loss_mask) if m]
        assert sampled == [i for text in turns for i in renderer.assistant_ids(text)]
        assert not any(seq.behavior_logprobs)


def test_build_demos_under_fold_plays_folded_for_solve_draws_and_keeps_the_other_scripts(renderer):
    from ctxrl.demos.play import _demo_scripts, build_demos
    from ctxrl.envs.search_qa import SearchQAEnv

    demos = asyncio.run(build_demos(FactHuntEnv, renderer, 6, seed=4, limits=_fold_limits()))
    assert all(d.success and d.truncation is None for d in demos)
    assert all(d.info["branches"] == 1 and [s.ended_by for s in d.segments] == ["fold"] for d in demos)
    assert [d.turns[i].text for d in demos for i in range(len(d.turns))] == \
        [text for d in demos for text in FactHuntEnv.folded(d.task)]
    full = asyncio.run(build_demos(FactHuntEnv, renderer, 6, seed=4))  # full context: solve, as always
    assert [d.task.id for d in full] == [d.task.id for d in demos]
    assert all(not d.segments and [t.text for t in d.turns] == FactHuntEnv.solve(d.task) for d in full)

    # the draw is the same with or without a solution hook: shortcut and redundant draws keep their scripts,
    # only the solve draws change (search_qa has shortcut and redundant; a stand-in plays its solve draws)
    tasks = SearchQAEnv.sample_tasks("train", 40, seed=0)
    marked = lambda task: ["solved by the stand-in"]  # noqa: E731
    plain = _demo_scripts(SearchQAEnv, 0.3, 0.2, random.Random(7))
    swapped = _demo_scripts(SearchQAEnv, 0.3, 0.2, random.Random(7), solve=marked)
    pairs = [(plain(t), swapped(t), t) for t in tasks]
    changed = [(a, b, t) for a, b, t in pairs if a != b]
    assert all(a == SearchQAEnv.solve(t) and b == marked(t) for a, b, t in changed)
    assert 0 < len(changed) < len(pairs)  # some draws were solve, the others shortcut or redundant, unchanged
    assert any(a == SearchQAEnv.shortcut(t) for a, b, t in pairs if a == b)


def test_an_env_without_folded_cannot_play_fold_demos(renderer):
    from ctxrl.demos.features import features
    from ctxrl.demos.play import build_demos
    from ctxrl.envs.calculator import CalculatorEnv

    assert get_manager("fold").solution_hook == "folded" and get_manager("fold").demo_hooks() == "folded(task)"
    assert not get_manager("fold").demo_ready(CalculatorEnv) and get_manager("fold").demo_ready(FactHuntEnv)
    with pytest.raises(ValueError, match="'calculator' has no folded\\(task\\) hook.*sft.context_demos=off"):
        asyncio.run(build_demos(CalculatorEnv, renderer, 2, limits=_fold_limits()))
    # check-env lists the feature
    assert features(FactHuntEnv)["demos played under fold (folded)"] is True
    assert features(CalculatorEnv)["demos played under fold (folded)"] is False


def test_fold_budget_ends_the_episode_when_the_live_context_would_not_fit(renderer):
    """The 4-page demo's live sequences: the longest prompt must leave room for a turn (80 tokens), no more."""
    task = _task(4)
    texts = FactHuntEnv.folded(task)
    free = _play(renderer, task, texts, _fold_limits())
    assert free.success and free.truncation is None  # budget 0: no budget, as before
    branch, parent = free.segments[0], free.sequences()[-1]
    # each generation's prompt is its sequence up to the turn's first sampled token: (prompt length, turn)
    prompts = sorted((i, seq.turn_index[i]) for seq in (branch, parent) for i in range(1, len(seq.loss_mask))
                     if seq.loss_mask[i] and not seq.loss_mask[i - 1])
    assert [turn for _, turn in sorted(prompts, key=lambda p: p[1])] == list(range(7))  # 7 turns: 4 + 3
    peak = prompts[-1][0]  # the longest prompt any turn was generated from
    peak_turn = min(turn for length, turn in prompts if length == peak)
    fits = _play(renderer, task, texts, _fold_limits(budget=peak + 80))
    assert fits.success and fits.truncation is None and fits.info["branches"] == 1
    cut = _play(renderer, task, texts, _fold_limits(budget=peak + 79))
    assert cut.truncation == "max_context" and not cut.success
    # the observation that would have made the longest prompt ended it: turns 0 .. peak_turn - 1 were played
    assert len(cut.turns) == peak_turn
    # a branch whose own task + goal leave no room ends the episode too; it is closed as unfinished
    opening = FactHuntEnv().reset(task)
    tools = [t.schema() for t in FactHuntEnv().tools] + FOLD_TOOL_SCHEMAS
    goal = "Follow the trail " * 6  # a 91-token call on the tiny tokenizer
    long_branch = [texts[0], format_tool_call("branch", {"goal": goal}), format_tool_call("return", {"result": "1"})]
    branch_prompt = len(renderer.prompt_ids(branch_messages(opening, goal), tools))
    tight = _play(renderer, task, long_branch, _fold_limits(budget=branch_prompt + 127, max_new_tokens=128))
    assert tight.truncation == "max_context" and [s.ended_by for s in tight.segments] == ["fold-unfinished"]
    assert len(tight.turns) == 2
    parent = tight.sequences()[-1]  # the branch turn was generated from a prompt that fit: the parent's
    assert len(parent.input_ids) - len(renderer.assistant_ids(long_branch[1])) < branch_prompt
    roomy = _play(renderer, task, long_branch, _fold_limits(budget=branch_prompt + 128, max_turns=3,
                                                           max_new_tokens=128))
    assert roomy.truncation == "max_turns" and [s.ended_by for s in roomy.segments] == ["fold"]


def _config(*overrides: str):
    return load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=fact_hunt", "context.manager=fold",
                              "rollout.max_new_tokens=80", "rollout.max_total_tokens=1024", "run.progress=false",
                              *overrides])


def test_fold_budget_config_checks():
    assert _config().context.max_context_tokens == 0  # no budget: fold as it always was
    assert _config("context.max_context_tokens=400").context.max_context_tokens == 400
    with pytest.raises(ConfigError, match="must not exceed rollout.max_total_tokens"):
        _config("context.max_context_tokens=2048")
    with pytest.raises(ConfigError, match="must exceed rollout.max_new_tokens"):
        _config("context.max_context_tokens=80")
    cfg = _config("context.max_context_tokens=400", "context.budget_start_tokens=800", "context.budget_steps=4")
    assert cfg.context.budget_start_tokens == 800  # the curriculum applies to fold with a budget
    with pytest.raises(ConfigError, match="budget_start_tokens.*between"):
        _config("context.max_context_tokens=400", "context.budget_start_tokens=300", "context.budget_steps=4")
    with pytest.raises(ConfigError, match="fold with context.max_context_tokens > 0"):
        _config("context.budget_start_tokens=800", "context.budget_steps=4")
    assert _config("sft.context_demos=on").sft.context_demos == "on"  # fold scripts demos (folded)
    assert get_manager("fold").keeps_budget(400) and not get_manager("fold").keeps_budget(0)
    assert get_manager("window").keeps_budget(0) and not get_manager("full").keeps_budget(400)


def test_fold_context_demos_on_without_the_hook_is_a_config_error_and_auto_falls_back(tmp_path):
    import warnings

    from ctxrl.run import loop
    from ctxrl.run.build import build
    from ctxrl.train.warm_start import context_demos, demo_limits

    run = build(_config("context.max_context_tokens=900", "sft.demos=4", "sft.epochs=1", "sft.batch_size=4",
                        "env.max_turns=8"), tmp_path / "fold")
    assert run.context_demos
    limits = demo_limits(run.spec, run.context_demos)
    assert limits.context.manager == "fold" and limits.context.max_context_tokens == 900
    row = loop.warm_start(run)
    assert row["context_demos"] and row["demo_branches_per_episode"] == 1.0
    with pytest.raises(ConfigError, match="sft.context_demos=on, but environment 'calculator' has no folded\\(task\\)"):
        build(_config("env.name=calculator", "sft.context_demos=on"), tmp_path / "on")
    from ctxrl.envs.calculator import CalculatorEnv

    assert not context_demos(_config("env.name=calculator"), CalculatorEnv)  # auto: no hook, no fold demos
    calc = build(_config("env.name=calculator", "sft.demos=4", "sft.epochs=1"), tmp_path / "calc")
    assert not calc.context_demos and demo_limits(calc.spec, calc.context_demos) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.warm_start(calc)
    assert any("no folded(task) hook" in str(w.message) and "no fold solutions" in str(w.message) for w in caught)


def test_trainer_logs_the_context_budget_of_a_budgeted_fold(tmp_path):
    from ctxrl.run.build import build
    from ctxrl.run.step import keep_trainable

    for budget, logged in ((0, False), (600, True)):
        run = build(_config(f"context.max_context_tokens={budget}", "sft.enabled=false", "env.max_turns=8",
                            "rollout.tasks_per_step=1", "rollout.group_size=2"), tmp_path / str(budget))
        metrics = {}
        from ctxrl.train.collect import Collected

        keep_trainable(run, 0, Collected([], [], metrics))
        assert ("context_budget" in metrics) == logged
        if logged:
            assert metrics["context_budget"] == 600
