"""The meta loop: trials as token-faithful sequences, trained reflections, carried context, early stop."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.minesweeper import MinesweeperEnv
from ctxrl.meta.metrics import to_trial
from ctxrl.meta.rollout import attempt_actions, attempt_header, feedback_text, run_trial, run_trials
from ctxrl.prompts import NOTES_HEADER, REFLECTION_INSTRUCTION
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.sections import MetaConfig
from ctxrl.types import Message

LIMITS = RolloutLimits(max_turns=8, max_new_tokens=64, max_total_tokens=2048)


@pytest.fixture(scope="module")
def task():
    return MinesweeperEnv.sample_tasks("train", 1, seed=3)[0]


def _mine_call(task) -> str:
    r, c = task.data["mines"][0]
    return format_tool_call("reveal", {"cells": f"{r},{c}"})


def _tools():
    return [t.schema() for t in MinesweeperEnv().tools]


class Reflections:
    """Scripted reflections, numbered, so that each is told apart."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"reflection {self.n}: that cell was a mine, reveal the numbered edge first"


def _trial(renderer, task, texts, policy, limits=LIMITS):
    engine = ScriptedEngine(texts, renderer, reflection=Reflections())
    trial = asyncio.run(run_trial(MinesweeperEnv, task, engine, renderer, limits, policy, seed=0))
    return trial, engine


def test_reflections_are_sampled_tokens_and_open_the_next_attempt(renderer, task):
    bad, good = _mine_call(task), MinesweeperEnv.solve(task)
    trial, engine = _trial(renderer, task, [bad, bad, *good], MetaConfig(num_attempts=4))
    records = trial.info["attempts"]
    assert trial.truncation is None and trial.success and len(records) == 3  # stopped at the first success
    assert [r["success"] for r in records] == [False, False, True] and trial.reward == 1.0
    sequences = trial.sequences()
    assert len(sequences) == 3 and [s.ended_by for s in sequences] == ["reflection", "reflection", "end"]
    assert engine.reflections == [records[0]["reflection"], records[1]["reflection"]]
    assert records[2]["reflection"] is None
    tools = _tools()
    opening = MinesweeperEnv().reset(task)
    for k, seq in enumerate(sequences):
        n = len(seq.input_ids)
        assert len(seq.loss_mask) == len(seq.behavior_logprobs) == len(seq.turn_index) == n
        # the sequence's prompt is exactly its opening messages, rendered; all context (mask 0)
        notes = [f"{feedback_text(j, 4, 0.0, False)} Your reflection: {records[j]['reflection']}" for j in range(k)]
        expected = opening if k == 0 else [
            opening[0], Message("user", task.prompt + NOTES_HEADER + "\n".join([*notes, attempt_header(k, 4)]))]
        prompt = renderer.prompt_ids(expected, tools)
        assert seq.input_ids[: len(prompt)] == prompt and not any(seq.loss_mask[: len(prompt)])
        assert records[k]["opening_tokens"] == len(prompt)
        if k < 2:
            # the reflection closes the sequence: exactly its sampled ids, mask 1 ...
            start = records[k]["reflection_start"]
            ids = renderer.assistant_ids(records[k]["reflection"])
            assert seq.input_ids[start:] == ids and all(seq.loss_mask[start:])
            # ... after the attempt's last observation, the feedback and the instruction, mask 0
            ask = [Message("tool", f"BOOM: {task.data['mines'][0][0]},{task.data['mines'][0][1]} was a mine.",
                           name="reveal"),
                   Message("user", f"{feedback_text(k, 4, 0.0, False)}\n{REFLECTION_INSTRUCTION}")]
            attempt_end = start - len(renderer.continuation_ids(seq.messages[:-3], ask, tools))
            assert seq.input_ids[attempt_end:start] == renderer.continuation_ids(seq.messages[:-3], ask, tools)
            assert not any(seq.loss_mask[attempt_end:start]) and seq.messages[-3:-1] == ask
            # the reflection text is in the next attempt's opening exactly as sampled
            assert records[k]["reflection"] in sequences[k + 1].messages[1].content
    # every generation's prompt is a prefix of the sequence it was sampled in
    for prompt in engine.prompts:
        assert any(seq.input_ids[: len(prompt)] == prompt for seq in sequences)
    # the sampled ids are the script and the reflections, in order, and nothing else
    script = [bad, *engine.reflections[:1], bad, *engine.reflections[1:], *good]
    assert [i for s in sequences for i, m in zip(s.input_ids, s.loss_mask) if m] == [
        i for text in script for i in renderer.assistant_ids(text)]
    assert to_trial(trial).rewards == [0.0, 0.0, 1.0] and to_trial(trial).solved_at == 2


def test_reflection_logprobs_match_the_learner(model, tokenizer, renderer, task):
    """Reflection tokens sampled by the real engine carry the learner's log-probs (mask 1)."""
    from ctxrl.engine.hf import HFEngine
    from ctxrl.train.learner import token_logprobs

    hf = HFEngine(model, pad_token_id=tokenizer.pad_token_id, seed=0)
    scripted = ScriptedEngine([_mine_call(task)] * 2, renderer)

    class Hybrid:
        policy_version = 0

        async def generate(self, prompt_ids, params):
            return await (hf if params.purpose == "reflection" else scripted).generate(prompt_ids, params)

    limits = RolloutLimits(max_turns=4, max_new_tokens=64, max_total_tokens=2048, temperature=1.0)
    policy = MetaConfig(num_attempts=2, reflection_max_tokens=12)
    trial = asyncio.run(run_trial(MinesweeperEnv, task, Hybrid(), renderer, limits, policy, seed=5))
    record = trial.info["attempts"][0]
    seq = trial.sequences()[0]
    start = record["reflection_start"]
    assert record["reflection_tokens"] == len(seq.input_ids) - start >= 1
    assert all(seq.loss_mask[start:]) and all(x < 0 for x in seq.behavior_logprobs[start:])
    ids = torch.tensor([seq.input_ids])
    with torch.no_grad():
        learner = token_logprobs(model, ids, torch.ones_like(ids))[0]  # log p(token t+1 | <= t)
    for i in range(start, len(seq.input_ids)):
        assert abs(learner[i - 1].item() - seq.behavior_logprobs[i]) < 1e-4


def test_stop_on_success_only_when_configured(renderer, task):
    good = MinesweeperEnv.solve(task)
    stopped, _ = _trial(renderer, task, good, MetaConfig(num_attempts=3))
    assert len(stopped.info["attempts"]) == 1 and not stopped.segments and stopped.info["reflections"] == 0
    full, engine = _trial(renderer, task, good * 3, MetaConfig(num_attempts=3, stop_on_success=False))
    assert [r["success"] for r in full.info["attempts"]] == [True, True, True]
    assert len(full.sequences()) == 3 and len(engine.reflections) == 2  # none after the last attempt
    assert full.reward == 3.0 and full.info["attempts"][0]["feedback"] == "Attempt 1 of 3 solved the task (reward 1)."
    failed, engine = _trial(renderer, task, [_mine_call(task)] * 3, MetaConfig(num_attempts=3))
    assert len(failed.info["attempts"]) == 3 and not failed.success and len(engine.reflections) == 2
    to_trial(failed).check()  # a full trial of failures is well formed


def test_attempts_context_without_reflection_is_the_in_context_rl_baseline(renderer, task):
    bad = _mine_call(task)
    trial, engine = _trial(renderer, task, [bad, bad, bad], MetaConfig(num_attempts=3, carry="attempts",
                                                                       reflect=False))
    assert engine.reflections == [] and trial.info["reflections"] == 0
    assert [s.ended_by for s in trial.sequences()] == ["attempt", "attempt", "end"]
    opening = MinesweeperEnv().reset(task)
    boom = Message("tool", f"BOOM: {task.data['mines'][0][0]},{task.data['mines'][0][1]} was a mine.", name="reveal")
    turn = Message("assistant", bad)
    expected = [*opening, turn, boom, Message("user", feedback_text(0, 3, 0.0, False)),
                Message("user", attempt_header(1, 3)), turn, boom, Message("user", feedback_text(1, 3, 0.0, False)),
                Message("user", attempt_header(2, 3))]
    last = trial.sequences()[2]
    prompt = renderer.prompt_ids(expected, _tools())
    assert last.input_ids[: len(prompt)] == prompt and not any(last.loss_mask[: len(prompt)])
    # only the attempts' own turns are trained
    assert sum(sum(s.loss_mask) for s in trial.sequences()) == 3 * len(renderer.assistant_ids(bad))


def test_plain_retries_carry_the_feedback_lines_only(renderer, task):
    bad = _mine_call(task)
    trial, engine = _trial(renderer, task, [bad, bad], MetaConfig(num_attempts=2, reflect=False))
    assert engine.reflections == []
    note = trial.sequences()[1].messages[1].content
    assert note.endswith(NOTES_HEADER + feedback_text(0, 2, 0.0, False) + "\n" + attempt_header(1, 2))


def test_the_carried_history_keeps_to_its_budget(renderer, task):
    from ctxrl.meta.rollout import Carried, reflections_opening

    bad = _mine_call(task)
    opening = MinesweeperEnv().reset(task)
    script = Reflections()
    notes = [Carried(k, [], feedback_text(k, 4, 0.0, False), script()) for k in range(2)]
    two_notes = len(renderer.prompt_ids(reflections_opening(opening, notes, 2, 4), _tools()))
    # a budget one token short of two notes: the oldest notes are dropped, the newest kept
    trial, _ = _trial(renderer, task, [bad] * 4, MetaConfig(num_attempts=4, max_context_tokens=two_notes - 1))
    records = trial.info["attempts"]
    assert [r["carried"] for r in records] == [0, 1, 1, 1] and [r["dropped"] for r in records] == [0, 0, 1, 2]
    assert all(r["opening_tokens"] <= two_notes - 1 for r in records)
    last = trial.sequences()[3].messages[1].content
    assert records[2]["reflection"] in last and feedback_text(2, 4, 0.0, False) in last
    assert records[0]["reflection"] not in last and records[1]["reflection"] not in last


def test_an_errored_attempt_errors_the_trial(renderer, task):
    built = []

    def make_env():
        built.append(1)
        if len(built) == 2:
            raise RuntimeError("no second board")
        return MinesweeperEnv()

    engine = ScriptedEngine([_mine_call(task)], renderer, reflection=Reflections())
    trial = asyncio.run(run_trial(make_env, task, engine, renderer, LIMITS, MetaConfig(num_attempts=3), seed=0))
    assert trial.truncation == "error" and trial.info["error_attempt"] == 1
    assert "no second board" in trial.info["error"] and len(trial.info["attempts"]) == 1


def test_attempt_one_is_the_single_episode_and_groups_are_tasks(renderer, task):
    """Attempt 1 of a trial is what the single episode with the same seed plays; trial k of task i has group i."""
    good = MinesweeperEnv.solve(task)
    single = asyncio.run(run_episode(MinesweeperEnv(), task, ScriptedEngine(good, renderer), renderer, LIMITS, seed=0))
    trial, _ = _trial(renderer, task, good, MetaConfig(num_attempts=2))
    assert trial.input_ids == single.input_ids and trial.loss_mask == single.loss_mask
    tasks = MinesweeperEnv.sample_tasks("train", 2, seed=4)
    engine = ScriptedEngine(["<answer>none</answer>"] * 8, renderer, reflection=Reflections())
    trials = asyncio.run(run_trials(MinesweeperEnv, tasks, engine, renderer, LIMITS, MetaConfig(num_attempts=2),
                                    group_size=2, seed=1))
    assert [t.group_id for t in trials] == [0, 0, 1, 1] and [t.task.id for t in trials[::2]] == [t.id for t in tasks]
    assert all(len(t.sequences()) == 2 and t.info["reflections"] == 1 for t in trials)


def test_actions_are_canonical_calls_and_answers():
    messages = [Message("user", "task"), Message("assistant", "x", tool_calls=[]),
                Message("assistant", "<answer>42</answer>")]
    from ctxrl.types import ToolCall

    messages.append(Message("assistant", "c", tool_calls=[ToolCall("reveal", {"cells": "0,1"})]))
    assert attempt_actions(messages) == ["answer(42)", 'reveal({"cells": "0,1"})']


def test_policy_checks_its_fields():
    from ctxrl.meta.rollout import check_trial

    with pytest.raises(ValueError, match="carry must be one of reflections, attempts"):
        check_trial(MetaConfig(carry="episodes"))
    with pytest.raises(ValueError, match="num_attempts must be >= 1"):
        check_trial(MetaConfig(num_attempts=0))


def test_evaluate_trials_reports_attempt_one_and_success_by_attempt(renderer):
    from ctxrl.eval.evaluate import evaluate_split
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import RolloutWorker

    [task] = MinesweeperEnv.sample_tasks("heldout", 1, seed=7)
    engine = ScriptedEngine([_mine_call(task), *MinesweeperEnv.solve(task)], renderer, reflection=Reflections())
    spec = RolloutSpec(eval=LIMITS, meta=MetaConfig(eval_attempts=3))
    worker = RolloutWorker(spec, engine, renderer, MinesweeperEnv)
    summary, trials = evaluate_split(worker, "heldout", 1, seed=7)
    assert len(trials) == 1 and trials[0].task.id == task.id
    # success, reward, tool calls: attempt 1's, as a single-episode evaluation reports them
    assert summary["success"] == 0.0 and summary["reward"] == 0.0 and summary["tool_calls"] == 1.0
    assert summary["trial_success"] == 1.0 and summary["attempts"] == 2.0
    assert summary["success_at_1"] == 0.0 and summary["success_at_2"] == 1.0 and math.isnan(summary["success_at_3"])
    assert [summary[f"success_by_{k}"] for k in (1, 2, 3)] == [0.0, 1.0, 1.0] and summary["pass_at_1"] == 0.0
    assert summary["reflections_per_trial"] == 1.0 and summary["errored"] == 0.0
    assert summary["turns_at_1"] == 1.0 and summary["turns_at_2"] == len(MinesweeperEnv.solve(task))
    assert summary["tool_errors_at_1"] == summary["tool_errors_at_2"] == 0.0 and "turns_at_3" not in summary
    assert summary["opening_tokens_at_2"] > summary["opening_tokens_at_1"]  # the note on attempt 1


def test_attempts_carry_the_environments_own_actions_and_failures(renderer, task):
    from ctxrl.meta.stats import trial_exploration

    bad, good = _mine_call(task), MinesweeperEnv.solve(task)
    trial, _ = _trial(renderer, task, [bad, bad, *good], MetaConfig(num_attempts=3))
    r, c = task.data["mines"][0]
    records = trial.info["attempts"]
    assert [rec["actions"] for rec in records[:2]] == [[f"reveal {r},{c}"]] * 2
    assert [rec["failed_actions"] for rec in records] == [[f"reveal {r},{c}"], [f"reveal {r},{c}"], []]
    cells = [f"reveal {x},{y}" for rnd in task.data["rounds"] for x, y in rnd]
    assert records[2]["actions"] == cells  # every revealed cell, in order; none failed
    counts = trial_exploration(to_trial(trial))
    assert counts["repeated_failed_actions"] == 1 and counts["later_attempt_actions"] == 1 + len(set(cells))
