"""Warm-start trial demos: a scripted failure, its reflection (trained), then the solution (trained)."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.config import ConfigError, load_config
from ctxrl.envs.bandit import BanditEnv
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.envs.minesweeper import MinesweeperEnv
from ctxrl.rollout.meta import NOTES_HEADER, MetaPolicy
from ctxrl.train.trial_demos import build_trial_demos, has_trial_hooks

POLICY = MetaPolicy(num_attempts=3, reflection_max_tokens=64)


def _trained_text(renderer, seq) -> str:
    return renderer.decode([i for i, m in zip(seq.input_ids, seq.loss_mask) if m])


@pytest.mark.parametrize("env_cls", [MinesweeperEnv, BanditEnv])
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
        solution = env_cls.solve(task)
        assert all(text.strip() in _trained_text(renderer, second) for text in solution)
        assert records[1]["turns"] == len(solution)


def test_reflections_are_written_from_the_failed_attempt(renderer):
    [trial] = asyncio.run(build_trial_demos(MinesweeperEnv, renderer, 1, POLICY, seed=5))
    r, c = trial.info["attempts"][0]["failed_actions"][0].removeprefix("reveal ").split(",")
    assert trial.info["attempts"][0]["reflection"].startswith(f"{r},{c} was a mine.")
    assert (int(r), int(c)) in {tuple(m) for m in trial.task.data["mines"]}
    [bandit] = asyncio.run(build_trial_demos(BanditEnv, renderer, 1, POLICY, seed=5))
    horizon = bandit.task.context["horizon"]
    assert f"of {horizon}." in bandit.info["attempts"][0]["reflection"]  # one arm, pulled every turn


def test_missing_hooks_and_short_budgets_are_clear_errors(renderer, tmp_path):
    assert has_trial_hooks(MinesweeperEnv) and not has_trial_hooks(CalculatorEnv)
    with pytest.raises(ValueError, match="no failure\\(task\\) and reflection\\(task, messages\\) hooks"):
        asyncio.run(build_trial_demos(CalculatorEnv, renderer, 2, POLICY))
    with pytest.raises(ValueError, match="at least 2 attempts with reflection"):
        asyncio.run(build_trial_demos(MinesweeperEnv, renderer, 2, MetaPolicy(num_attempts=1)))
    with pytest.raises(RuntimeError, match="longer than meta.reflection_max_tokens=4"):
        asyncio.run(build_trial_demos(MinesweeperEnv, renderer, 2, MetaPolicy(num_attempts=2,
                                                                                reflection_max_tokens=4)))
    from ctxrl.train.loop import Run

    with pytest.raises(ConfigError, match="environment 'calculator' has no failure"):
        Run(load_config(None, ["model.name=tiny:pretrain_steps=0", "sft.trial_demos=0.5", "run.progress=false"]),
            tmp_path / "calc")
    with pytest.raises(ConfigError, match="sft.trial_demos must be in"):
        load_config(None, ["sft.trial_demos=2"])


def test_the_warm_start_mixes_trial_demos_in(tmp_path):
    from ctxrl.train.loop import Run

    run = Run(load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=minesweeper", "sft.demos=8",
                                 "sft.trial_demos=0.25", "sft.epochs=1", "sft.batch_size=8", "meta.eval_attempts=3",
                                 "run.progress=false"]), tmp_path)
    row = run.warm_start()
    assert row["demos"] == 8 and row["trial_demos"] == 2
    sft = [s for s in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sft  # the first demos are logged as samples
