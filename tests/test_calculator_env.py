"""The calculator environment, check_env, and the registry."""

from __future__ import annotations

import asyncio
import random

import pytest

from ctxrl.chat.toolcalls import format_tool_call, parse_assistant
from ctxrl.envs import CheckEnvError, Env, EnvError, assert_env_ok, check_env, get_env_class, list_envs, register
from ctxrl.envs.calculator import CalculatorEnv, answers_equal, generate, parse_answer
from ctxrl.tools import safe_eval
from ctxrl.types import Message, Task


def test_check_env_passes() -> None:
    assert check_env(CalculatorEnv) == []
    assert_env_ok(CalculatorEnv, n_tasks=4, seed=1)
    assert isinstance(CalculatorEnv(), Env)


def test_tasks_are_consistent() -> None:
    for split in ("train", "heldout", "ood"):
        for task in CalculatorEnv.sample_tasks(split, 50, seed=0):
            expression = task.data["expression"]
            numbers = [tok for tok in expression.split() if tok.isdigit()]
            assert len(numbers) == task.context["ops"] + 1
            assert all(len(n) == task.context["digits"] for n in numbers)
            # The numbers appear in the prompt in the order of the expression.
            position = 0
            for n in numbers:
                position = task.prompt.index(n, position) + len(n)
            assert str(safe_eval(expression)) == task.answer
            assert task.id.startswith("calculator-") and task.split == split


def test_ood_tasks_use_four_digit_numbers() -> None:
    for task in CalculatorEnv.sample_tasks("ood", 30, seed=0):
        assert task.context["digits"] == 4
        assert all(len(n) == 4 for n in task.data["expression"].split() if n.isdigit())
    for task in CalculatorEnv.sample_tasks("train", 100, seed=0):
        assert task.context["digits"] <= 3


def test_splits_disjoint_and_reproducible() -> None:
    train = CalculatorEnv.sample_tasks("train", 500, seed=0)
    heldout = CalculatorEnv.sample_tasks("heldout", 500, seed=0)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert [t.id for t in train] == [t.id for t in CalculatorEnv.sample_tasks("train", 500, seed=0)]
    assert [t.id for t in train] != [t.id for t in CalculatorEnv.sample_tasks("train", 500, seed=1)]


def test_word_to_operator_mapping_is_unambiguous() -> None:
    words = {"plus": "+", "minus": "-", "times": "*", "more": "+", "away": "-"}
    rng = random.Random(0)
    templates = set()
    for _ in range(500):
        context = {"digits": rng.randint(1, 3), "ops": rng.randint(1, 2)}
        prompt, _, data = generate(context, rng)
        templates.add(data["template"])
        ops_in_prompt = [words[w.strip(",.?")] for w in prompt.split() if w.strip(",.?") in words]
        assert ops_in_prompt == [tok for tok in data["expression"].split() if tok in "+-*"]
    assert len(templates) == 4


def _episode(env: CalculatorEnv, task: Task, texts: list[str]) -> list:
    env.reset(task, seed=0)
    return [asyncio.run(env.step(parse_assistant(text))) for text in texts]


def test_gold_episode_rewards_and_observations() -> None:
    task = Task(id="t", prompt="What is 37 plus 58 times 4?", answer="269", data={"expression": "37 + 58 * 4"})
    env = CalculatorEnv()
    messages = env.reset(task)
    assert [m.role for m in messages] == ["system", "user"] and messages[1].content == task.prompt
    tool_step, answer_step = _episode(env, task, CalculatorEnv.solve(task))
    assert tool_step.messages[0].content == "269" and tool_step.messages[0].name == "calculator"
    assert tool_step.reward == 0.0 and not tool_step.terminated
    assert tool_step.info == {"tool_calls": 1, "tool_errors": 0, "malformed_tool_calls": 0}
    assert answer_step.reward == 1.0 and answer_step.terminated
    assert answer_step.info == {"answered": True, "correct": True}
    with pytest.raises(EnvError, match="after the episode terminated"):
        asyncio.run(env.step(Message(role="assistant", content="<answer>269</answer>")))
    env.close()
    env.close()
    with pytest.raises(EnvError, match="before reset"):
        asyncio.run(env.step(Message(role="assistant", content="<answer>269</answer>")))


def test_wrong_missing_and_shortcut_answers() -> None:
    task = CalculatorEnv.sample_tasks("train", 1, seed=0)[0]
    env = CalculatorEnv()
    (wrong,) = _episode(env, task, [f"<answer>{int(task.answer) + 1}</answer>"])
    assert wrong.reward == 0.0 and wrong.info == {"answered": True, "correct": False}
    (missing,) = _episode(env, task, [task.answer])
    assert missing.reward == 0.0 and missing.info == {"answered": False, "correct": False}
    (shortcut,) = _episode(env, task, CalculatorEnv.shortcut(task))
    assert shortcut.reward == 1.0


def test_malformed_tool_call_is_an_observation() -> None:
    task = CalculatorEnv.sample_tasks("train", 1, seed=0)[0]
    (step,) = _episode(CalculatorEnv(), task, ["<tool_call>{oops</tool_call>"])
    assert not step.terminated and step.messages[0].content.startswith("Error: malformed tool call")
    assert step.info["malformed_tool_calls"] == 1 and step.info["tool_errors"] == 1


def test_answer_parsing() -> None:
    assert parse_answer("so <answer> 42 </answer>") == "42"
    assert parse_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert parse_answer("42") is None
    assert answers_equal("42.0", "42") and answers_equal(" -7 ", "-7") and answers_equal("+5", "5")
    assert not answers_equal("42.5", "42") and not answers_equal("forty", "42") and not answers_equal("", "0")


def test_solve_writes_canonical_tool_call() -> None:
    task = CalculatorEnv.sample_tasks("train", 1, seed=0)[0]
    texts = CalculatorEnv.solve(task)
    assert texts == [format_tool_call("calculator", {"expression": task.data["expression"]}),
                     f"<answer>{task.answer}</answer>"]


def test_corpus_covers_episode_text() -> None:
    texts = CalculatorEnv.corpus(20, seed=0)
    joined = "\n".join(texts)
    for needle in (CalculatorEnv.system_prompt, "<tool_call>", "<answer>", "<tool_response>", '"calculator"'):
        assert needle in joined
    assert CalculatorEnv.corpus(20, seed=0) == texts


class WrongSolveEnv(CalculatorEnv):
    @classmethod
    def solve(cls, task: Task) -> list[str]:
        return [f"<answer>{int(task.answer) + 1}</answer>"]


class NondeterministicResetEnv(CalculatorEnv):
    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        messages = super().reset(task, seed=seed)
        messages[0].content += f" ({random.random()})"
        return messages


class LeakySplitEnv(CalculatorEnv):
    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        tasks = CalculatorEnv.sample_tasks("train", n, seed)
        for task in tasks:
            task.split = split
        return tasks


class NoTerminateAfterEnv(CalculatorEnv):
    async def step(self, message: Message):  # type: ignore[override]
        self._terminated = False
        return await super().step(message)


def test_check_env_reports_wrong_solve() -> None:
    problems = check_env(WrongSolveEnv, n_tasks=2)
    assert any("total reward 0.0 != 1.0" in p for p in problems)
    with pytest.raises(CheckEnvError, match="failed"):
        assert_env_ok(WrongSolveEnv, n_tasks=2)


def test_check_env_reports_nondeterministic_reset() -> None:
    problems = check_env(NondeterministicResetEnv, n_tasks=2)
    assert len(problems) == 1 and "is not deterministic" in problems[0]


def test_check_env_reports_leaky_splits() -> None:
    problems = check_env(LeakySplitEnv, n_tasks=4)
    assert any("train and heldout share" in p for p in problems)
    assert any("not valid for split 'ood'" in p for p in problems)


def test_check_env_reports_step_after_termination() -> None:
    problems = check_env(NoTerminateAfterEnv, n_tasks=2)
    assert any("after termination did not raise" in p for p in problems)


def test_registry() -> None:
    assert get_env_class("calculator") is CalculatorEnv
    assert get_env_class("ctxrl.envs.calculator:CalculatorEnv") is CalculatorEnv
    assert "calculator" in list_envs()
    with pytest.raises(EnvError, match="did you mean 'calculator'.*known environments: .*calculator"):
        get_env_class("calculater")
    with pytest.raises(EnvError, match="has no class 'Nope'"):
        get_env_class("ctxrl.envs.calculator:Nope")
    with pytest.raises(EnvError, match="cannot import module"):
        get_env_class("ctxrl.no_such_module:Env")
    with pytest.raises(EnvError, match="already registered"):
        register("calculator")(WrongSolveEnv)


def test_environment_docs_pages_are_in_sync():
    from ctxrl.envs.docs import DOCS, documented_envs, env_page

    names = documented_envs()
    assert {"calculator", "kv_chain", "bandit", "python_math", "search_qa", "sokoban", "minesweeper"} <= set(names)
    for name in names:
        page = DOCS / f"{name}.md"
        assert page.exists() and page.read_text() == env_page(name), \
            f"docs/envs/{name}.md is stale: regenerate with `python -m ctxrl.envs.docs`"
