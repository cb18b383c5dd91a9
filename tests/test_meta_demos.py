"""Annealed demonstrations: prompt context (mask 0), never the task's own, fading to none, never at evaluation."""

from __future__ import annotations

import asyncio
import json

import pytest

from ctxrl.config import ConfigError, load_config
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.envs.minesweeper import MinesweeperEnv
from ctxrl.meta.demos import (
    DEMOS_HEADER,
    TASK_HEADER,
    Demo,
    demo_text,
    demos_excluding,
    load_demos,
    solved_demos,
    with_demos,
)
from ctxrl.rollout.agent import run_episodes
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.types import Message

LIMITS = RolloutLimits(max_turns=4, max_new_tokens=256, max_total_tokens=4096)


def test_demos_are_prompt_context_and_never_trained(renderer):
    task = CalculatorEnv.sample_tasks("train", 1, seed=3)[0]
    pool = demos_excluding(solved_demos(CalculatorEnv, renderer, 4, seed=9), task)
    shown = pool[:2]
    texts = CalculatorEnv.solve(task)
    engine = ScriptedEngine(texts, renderer)
    [episode] = asyncio.run(run_episodes(CalculatorEnv, [task], engine, renderer, LIMITS,
                                         opening=lambda i, k, messages: with_demos(messages, shown)))
    assert episode.success
    opening = CalculatorEnv().reset(task)
    with_shown = with_demos(opening, shown)
    assert with_shown[0] == opening[0] and with_shown[1].content.endswith(f"{TASK_HEADER}\n{task.prompt}")
    assert with_shown[1].content.startswith(DEMOS_HEADER) and demo_text(shown[1], 2) in with_shown[1].content
    prompt = renderer.prompt_ids(with_shown, [t.schema() for t in CalculatorEnv().tools])
    # the demos are part of the prompt the episode starts from: mask 0, behaviour log-prob 0
    assert episode.input_ids[: len(prompt)] == prompt and engine.prompts[0] == prompt
    assert not any(episode.loss_mask[: len(prompt)]) and not any(episode.behavior_logprobs[: len(prompt)])
    # and the trained tokens are exactly the policy's turns
    assert [i for i, m in zip(episode.input_ids, episode.loss_mask) if m] == [
        i for text in texts for i in renderer.assistant_ids(text)]
    # no demos: the opening and the episode are as before (no "demos" key either)
    [plain] = asyncio.run(run_episodes(CalculatorEnv, [task], ScriptedEngine(texts, renderer), renderer, LIMITS))
    assert "demos" not in plain.info and DEMOS_HEADER not in renderer.decode(plain.input_ids)
    assert with_demos(opening, []) == opening


def test_solved_demos_hold_the_solution_and_never_the_task_played(renderer):
    pool = solved_demos(MinesweeperEnv, renderer, 4, seed=2)
    assert len(pool) == 4
    for demo in pool:
        assert demo.messages[0].role == "assistant" and "reveal" in demo.messages[0].content
        assert demo.messages[-1].role == "assistant"  # the observations that ended it were never shown
    task = MinesweeperEnv.sample_tasks("train", 4, seed=2)[1]
    assert [d.task_id for d in demos_excluding(pool, task)] == [d.task_id for d in pool if d.task_id != task.id]
    same_prompt = Demo(task_id="elsewhere", prompt=task.prompt)
    assert demos_excluding([same_prompt], task) == []


def test_demos_load_from_jsonl(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 plus 2?", "messages": [
        {"role": "assistant", "content": "<answer>4</answer>"}]}) + "\n\n" + json.dumps(
        {"id": "b", "prompt": "What is 3 plus 3?", "messages": [{"role": "assistant", "content": "6"}]}) + "\n")
    demos = load_demos(path)
    assert [d.task_id for d in demos] == ["demos.jsonl:1", "b"]
    assert demos[0].messages == [Message("assistant", "<answer>4</answer>")]
    assert demo_text(demos[0], 1) == "Example 1.\nTask: What is 2 plus 2?\nAssistant: <answer>4</answer>"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*\"messages\""):
        load_demos(bad)
    with pytest.raises(FileNotFoundError, match="meta.demos.source"):
        load_demos(tmp_path / "missing.jsonl")


class Recording:
    """Wraps an engine and keeps every prompt it is asked to continue."""

    def __init__(self, engine) -> None:
        self.engine, self.prompts = engine, []

    @property
    def policy_version(self):
        return self.engine.policy_version

    def load_weights(self, state, *, version: int) -> None:
        self.engine.load_weights(state, version=version)

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        return await self.engine.generate(prompt_ids, params)


SMALL = ["model.name=tiny:pretrain_steps=0", "env.name=calculator", "rollout.tasks_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4", "eval.tasks=2", "run.progress=false", "sft.enabled=false",
         "meta.demos.max=2", "meta.demos.steps=3", "meta.demos.pool=6"]


def test_schedule_reaches_zero_and_evaluation_never_sees_demos(tmp_path, monkeypatch):
    from ctxrl.rollout.spec import RolloutRequest
    from ctxrl.run import loop
    from ctxrl.run.build import build
    from ctxrl.train import evaluation

    run = build(load_config(None, SMALL), tmp_path)
    tasks = CalculatorEnv.sample_tasks("train", 2, seed=0)

    def chooser(step: int, phase: str = "train"):
        return run.worker.runner.demo_chooser(RolloutRequest(tasks=tasks, group_size=2, step=step, phase=phase))

    # linear count schedule from 2 at step 0 to exactly 0 at step 3: ceil(2 * (3 - s) / 3)
    counts = [len(chooser(s)(0, 0)) for s in range(3)]
    assert counts == [2, 2, 1]
    assert chooser(3) is not None
    assert all(chooser(s)(i, k) == [] for s in (3, 4, 50) for i in (0, 1) for k in (0, 1))
    assert chooser(0, phase="eval") is None
    # a task is never shown its own demo
    for i, task in enumerate(tasks):
        assert all(d.task_id != task.id for d in chooser(0)(i, 1))
    run.worker.engine = Recording(run.worker.engine)
    early = run.collector.rollout_round(0, 0)
    assert [e.info["demos"] for e in early] == [2, 2, 2, 2]
    assert all(DEMOS_HEADER in run.renderer.decode(e.input_ids) for e in early)
    late = run.collector.rollout_round(3, 0)
    assert [e.info["demos"] for e in late] == [0, 0, 0, 0]
    assert not any(DEMOS_HEADER in run.renderer.decode(e.input_ids) for e in late)
    engine = run.worker.engine
    engine.prompts.clear()
    summary = loop.evaluate(run, 0, splits=("heldout",))["heldout"]
    assert engine.prompts and not any(DEMOS_HEADER in run.renderer.decode(p) for p in engine.prompts)
    assert "success" in summary

    def leaky(worker, split, n, *, seed, trials_per_task=1, on_episode=None):
        leak = RolloutRequest(tasks=worker.env_cls.sample_tasks(split, n, seed), seed=seed, phase="train")
        return {}, worker.run(leak)  # training settings: the step-0 demos

    monkeypatch.setattr(evaluation, "evaluate_split", leaky)
    with pytest.raises(RuntimeError, match="must be zero-shot"):
        loop.evaluate(run, 0, splits=("heldout",))
    run.writer.close()


def test_demo_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="needs meta.demos.steps > 0"):
        load_config(None, ["meta.demos.max=2"])
    with pytest.raises(ConfigError, match="must exceed meta.demos.max"):
        load_config(None, ["meta.demos.max=4", "meta.demos.steps=5", "meta.demos.pool=4"])
    with pytest.raises(ConfigError, match="solve or a .jsonl file"):
        load_config(None, ["meta.demos.source=demos.txt"])
    with pytest.raises(ConfigError, match=r"\[meta.demos\]: kind must be one of linear, cosine, step"):
        load_config(None, ["meta.demos.kind=exp"])
    from ctxrl.run.build import build

    missing = load_config(None, [*SMALL, f"meta.demos.source={tmp_path / 'none.jsonl'}"])
    with pytest.raises(ConfigError, match="does not exist"):
        build(missing, tmp_path / "run")
