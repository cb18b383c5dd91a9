"""The codebreak environment: feedback by hand (repeats included), the guess tool and its budget, and the meta-RL
property it exists for: a failed first attempt's note lets a second attempt finish where one attempt could not."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.chat.toolcalls import parse_assistant
from ctxrl.envs import assert_env_ok, get_env_class, list_envs
from ctxrl.envs.codebreak import CodebreakEnv, feedback, knowledge
from ctxrl.types import Message


def test_conformance_and_registry():
    assert_env_ok(CodebreakEnv, n_tasks=16)
    assert "codebreak" in list_envs() and get_env_class("codebreak") is CodebreakEnv


@pytest.mark.parametrize("code,guess,marks", [
    ("3142", "3142", "===="), ("3142", "1111", "-=--"), ("3142", "2413", "++++"), ("3142", "3312", "=-+="),
    ("1123", "1311", "=++-"),  # two 1s in the code: the third 1 of the guess is not in it
    ("1223", "2222", "-==-"), ("4444", "1234", "---="),
])
def test_feedback_by_hand(code, guess, marks):
    assert feedback(code, guess) == marks


def test_knowledge_from_probes():
    known, absent = knowledge(4, [("1111", "-=--"), ("2222", "---="), ("3333", "----")])
    assert known == [None, "1", None, "2"] and absent == {"3"}


def _play(env, task, texts):
    env.reset(task)
    result = None
    for text in texts:
        result = asyncio.run(env.step(parse_assistant(text)))
        if result.terminated:
            break
    return result


def test_guesses_end_the_attempt_solved_or_spent():
    task = next(t for t in CodebreakEnv.sample_tasks("train", 20, seed=1) if t.context["guesses"] == 3)
    env = CodebreakEnv()
    solved = _play(env, task, CodebreakEnv.solve(task))
    assert solved.terminated and solved.reward == 1.0 and solved.info["correct"] is True
    wrong = str(int(task.data["code"][0]) % task.context["symbols"] + 1) * task.context["length"]
    from ctxrl.chat.toolcalls import format_tool_call

    calls = [format_tool_call("guess", {"code": wrong})] * 3
    spent = _play(env, task, calls)
    assert spent.terminated and spent.reward == 0.0
    env.reset(task)
    bad = asyncio.run(env.step(parse_assistant(format_tool_call("guess", {"code": "9" * 9}))))
    assert bad.messages[0].content.startswith("Error") and "a guess is" in bad.messages[0].content
    assert not bad.terminated  # a malformed guess costs nothing
    answered = asyncio.run(env.step(Message(role="assistant", content=f"<answer>{task.data['code']}</answer>")))
    assert answered.terminated and answered.reward == 1.0


def test_a_failed_attempts_note_finishes_the_second_attempt():
    """The scripted first attempt probes 1111, 2222, ... and runs out; its reflection names what the feedback
    proved, and the second attempt that follows it solves every task whose digits the two attempts' probes cover."""
    env = CodebreakEnv()
    tasks = CodebreakEnv.sample_tasks("train", 60, seed=2) + CodebreakEnv.sample_tasks("ood", 20, seed=2)
    needed_two = 0
    for task in tasks:
        first = _play(env, task, CodebreakEnv.failure(task))
        transcript = [Message(role="system", content="s"), Message(role="user", content=task.prompt)]
        env.reset(task)
        for text in CodebreakEnv.failure(task):
            message = parse_assistant(text)
            result = asyncio.run(env.step(message))
            transcript += [message, *result.messages]
            if result.terminated:
                break
        note = CodebreakEnv.reflection(task, transcript)
        assert note.startswith("Known: ")
        second = _play(env, task, CodebreakEnv.solve_after(task, note))
        assert first.reward == 0.0, task.data["code"]  # the scripted first attempt always fails
        symbols, guesses = task.context["symbols"], task.context["guesses"]
        if symbols <= 2 * guesses:
            assert second.reward == 1.0, (task.data["code"], note)
        needed_two += first.reward == 0.0 and second.reward == 1.0
    assert needed_two >= len(tasks) // 2  # for most tasks one attempt is not enough and two are


def test_a_win_stays_a_win_and_a_repeated_digit_code_still_fails_its_probe():
    from ctxrl.chat.toolcalls import format_tool_call
    from ctxrl.types import Task

    task = Task(id="t", prompt="p", answer="222", data={"code": "222"},
                context={"length": 3, "symbols": 5, "guesses": 3})
    env = CodebreakEnv()
    env.reset(task)
    both = parse_assistant(format_tool_call("guess", {"code": "222"}) + "\n"
                           + format_tool_call("guess", {"code": "111"}))
    result = asyncio.run(env.step(both))
    assert result.terminated and result.reward == 1.0  # the second call of the turn cannot undo the win
    assert "already found" in result.messages[1].content
    probes = [parse_assistant(t).tool_calls[0].arguments["code"] for t in CodebreakEnv.failure(task)]
    assert probes == ["111", "333", "444"] and _play(env, task, CodebreakEnv.failure(task)).reward == 0.0


def test_the_failed_attempt_uses_every_guess_so_it_ends_by_running_out():
    """With as many guesses as symbols and a one-digit code skipped, the probes would run short and a scripted
    trial demo would ask its engine for a turn it does not have (seen on a GPU run): the last probe repeats."""
    from ctxrl.types import Task

    task = Task(id="t", prompt="p", answer="3333", data={"code": "3333"},
                context={"length": 4, "symbols": 4, "guesses": 4})
    probes = [parse_assistant(t).tool_calls[0].arguments["code"] for t in CodebreakEnv.failure(task)]
    assert probes == ["1111", "2222", "4444", "4444"]
    assert _play(CodebreakEnv(), task, CodebreakEnv.failure(task)).reward == 0.0
    for task in CodebreakEnv.sample_tasks("train", 300, seed=4) + CodebreakEnv.sample_tasks("ood", 100, seed=4):
        assert len(CodebreakEnv.failure(task)) == task.context["guesses"]


def test_trial_demos_play_on_many_tasks_with_the_experiments_limits(renderer):
    from ctxrl.meta.trial_demos import build_trial_demos
    from ctxrl.rollout.spec import RolloutLimits
    from ctxrl.sections import MetaConfig

    limits = RolloutLimits(max_turns=6, max_new_tokens=32, max_total_tokens=1536)  # experiments/meta.py's
    trials = asyncio.run(build_trial_demos(CodebreakEnv, renderer, 60, MetaConfig(num_attempts=3,
                                           reflection_max_tokens=96), seed=0, limits=limits))
    assert len(trials) == 60
