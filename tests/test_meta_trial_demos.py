"""Warm-start trial demos: a scripted failure, its reflection (trained), then the solution (trained)."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.config import ConfigError, load_config
from ctxrl.envs.bandit import BanditEnv
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.envs.codebreak import CodebreakEnv
from ctxrl.envs.hooks import has_trial_hooks
from ctxrl.envs.minesweeper import MinesweeperEnv
from ctxrl.meta.trial_demos import build_trial_demos
from ctxrl.prompts import NOTES_HEADER
from ctxrl.sections import MetaConfig
from ctxrl.types import Message

POLICY = MetaConfig(num_attempts=3, reflection_max_tokens=64)


def _trained_text(renderer, seq) -> str:
    return renderer.decode([i for i, m in zip(seq.input_ids, seq.loss_mask) if m])


@pytest.mark.parametrize("env_cls", [MinesweeperEnv, BanditEnv, CodebreakEnv])
def test_a_trial_demo_trains_the_reflection_and_the_solution_only(renderer, env_cls):
    trials = asyncio.run(build_trial_demos(env_cls, renderer, 6, POLICY, seed=2))
    assert len(trials) == 6
    for trial in trials:
        task, (first, second) = trial.task, trial.sequences()
        records = trial.info["attempts"]
        assert [(r["success"], r["truncation"]) for r in records] == [(False, None), (True, None)]
        assert records[0]["reflection"] and records[1]["reflection"] is None
        # attempt 1: the mistake stays context (mask 0); only the reflection after it is trained
        start = records[0]["reflection_start"]
        assert not any(first.loss_mask[:start]) and all(first.loss_mask[start:])
        assert _trained_text(renderer, first).startswith(records[0]["reflection"])
        # attempt 2 opens with the note and plays the solution, every turn of it trained
        opening = renderer.decode(second.input_ids[:second.loss_mask.index(1)])
        assert NOTES_HEADER.strip() in opening and records[0]["reflection"] in opening
        assert "This is attempt 2 of 3." in opening
        follow = getattr(env_cls, "solve_after", None)
        solution = follow(task, records[0]["reflection"]) if follow else env_cls.solve(task)
        assert all(text.strip() in _trained_text(renderer, second) for text in solution)
        assert records[1]["turns"] == len(solution)


def test_reflections_are_written_from_the_failed_attempt(renderer):
    [trial] = asyncio.run(build_trial_demos(MinesweeperEnv, renderer, 1, POLICY, seed=5))
    r, c = trial.info["attempts"][0]["failed_actions"][0].removeprefix("reveal ").split(",")
    assert trial.info["attempts"][0]["reflection"].startswith(f"{r},{c} was a mine.")
    assert (int(r), int(c)) in {tuple(m) for m in trial.task.data["mines"]}
    # the bandit's second attempt pulls what its note names: the note matters, and only solved ones are kept
    for bandit in asyncio.run(build_trial_demos(BanditEnv, renderer, 8, POLICY, seed=5)):
        note = bandit.info["attempts"][0]["reflection"]
        pulled = [a.split()[1] for a in bandit.info["attempts"][1]["actions"]]
        colours = bandit.task.data["colours"]
        assert [r["success"] for r in bandit.info["attempts"]] == [False, True]
        if colours:
            assert all(f"{c} arm {a}" in note if f"{c} arm" in note else a == "0" for c, a in zip(colours, pulled))
        else:
            assert note.endswith(f"pull arm {pulled[0]}.") and len(set(pulled)) == 1


def _said(*turns):
    """An attempt's conversation: (arm, reward, colour shown next or None) per pull."""
    from ctxrl.types import ToolCall

    out = [Message("user", "There are 3 slot machines." + (f"\nColour: {turns[0][3]}" if len(turns[0]) > 3 else ""))]
    for arm, reward, after, *_ in turns:
        out.append(Message("assistant", "", tool_calls=[ToolCall("pull", {"arm": arm})]))
        out.append(Message("tool", f"reward {reward}" + (f"\nColour: {after}" if after else ""), name="pull"))
    return out


def test_bandit_reflection_and_following_it_by_hand():
    plain = BanditEnv.sample_tasks("train", 50, 1)
    task = next(t for t in plain if not t.context["contextual"])
    # arm 0 paid 1 of 2, arm 1 paid 2 of 2: arm 1
    note = BanditEnv.reflection(task, _said((0, 0, None), (1, 1, None), (0, 1, None), (1, 1, None)))
    assert note == "Arm 1 paid most. Next time: pull arm 1."
    assert BanditEnv.solve_after(task, note) == [format_tool_call("pull", {"arm": 1})] * task.context["horizon"]
    # by colour: red arm 0 paid, blue arm 2 paid, arm 1 never did; each pull's colour is the one shown before it
    coloured = next(t for t in plain if t.context["contextual"])
    said = _said((1, 0, "red", "red"), (0, 1, "blue"), (2, 1, "blue"), (1, 0, None))
    note = BanditEnv.reflection(coloured, said)
    assert note == "Next time: blue arm 2, red arm 0."
    pulls = BanditEnv.solve_after(coloured, note)
    want = {"red": 0, "blue": 2}
    assert pulls == [format_tool_call("pull", {"arm": want.get(c, 0)}) for c in coloured.data["colours"]]
    assert BanditEnv.reflection(task, [Message("user", "task")]).startswith("No valid pull")


def test_missing_hooks_and_short_budgets_are_clear_errors(renderer, tmp_path):
    assert has_trial_hooks(MinesweeperEnv) and not has_trial_hooks(CalculatorEnv)
    with pytest.raises(ValueError, match="no failure\\(task\\) and reflection\\(task, messages\\) hooks"):
        asyncio.run(build_trial_demos(CalculatorEnv, renderer, 2, POLICY))
    with pytest.raises(ValueError, match="at least 2 attempts with reflection"):
        asyncio.run(build_trial_demos(MinesweeperEnv, renderer, 2, MetaConfig(num_attempts=1)))
    with pytest.raises(RuntimeError, match="longer than meta.reflection_max_tokens=4"):
        asyncio.run(build_trial_demos(MinesweeperEnv, renderer, 2, MetaConfig(num_attempts=2,
                                                                                reflection_max_tokens=4)))
    from ctxrl.run.build import build

    with pytest.raises(ConfigError, match="environment 'calculator' has no failure"):
        build(load_config(None, ["model.name=tiny:pretrain_steps=0", "sft.trial_demos=0.5", "run.progress=false"]),
              tmp_path / "calc")
    with pytest.raises(ConfigError, match="sft.trial_demos must be in"):
        load_config(None, ["sft.trial_demos=2"])


def test_the_warm_start_mixes_trial_demos_in(tmp_path):
    from ctxrl.run import loop
    from ctxrl.run.build import build

    run = build(load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=minesweeper", "sft.demos=8",
                                   "sft.trial_demos=0.25", "sft.epochs=1", "sft.batch_size=8", "meta.eval_attempts=3",
                                   "run.progress=false"]), tmp_path)
    row = loop.warm_start(run)
    assert row["demos"] == 8 and row["trial_demos"] == 2
    sft = [s for s in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sft  # the first demos are logged as samples


def test_notes_that_never_lead_to_a_solution_are_an_error_not_a_silent_shortfall(renderer):
    class Stubborn(BanditEnv):  # follows its note by pulling arm 0 and nothing else
        @classmethod
        def solve_after(cls, task, reflection):
            return [format_tool_call("pull", {"arm": min(range(task.context["arms"]),
                                                         key=task.data["probs"][0].__getitem__)})] * 16

    plain = [t for t in BanditEnv.sample_tasks("train", 40, 3) if not t.context["contextual"]]
    Stubborn.sample_tasks = classmethod(lambda cls, split, n, seed: plain[:n])
    with pytest.raises(RuntimeError, match="only 0 of 2 trial demos of 'bandit' were solved by following"):
        asyncio.run(build_trial_demos(Stubborn, renderer, 2, POLICY))
