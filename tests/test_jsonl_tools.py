"""jsonl_tools: tasks from a user's JSONL file, tools and verifiers by name, clear errors, the loop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ctxrl.envs import EnvError, assert_env_ok
from ctxrl.envs.jsonl_tools import JsonlToolsEnv, load_tasks
from ctxrl.envs.registry import configured_env_class
from ctxrl.types import Message


@pytest.fixture
def task_file(tmp_path):
    rows = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a in range(2, 12) for b in range(3, 9)]
    rows[0]["solution"] = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>',
                           "<answer>6</answer>"]
    rows += [{"prompt": f"Big: {a} * 997?", "answer": str(a * 997), "split": "ood", "id": f"big{a}",
              "context": {"digits": 3}} for a in range(100, 130)]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_conformance_splits_and_solutions(task_file):
    env_cls = configured_env_class("jsonl_tools", data=str(task_file), tools="calculator", verifier="numeric")
    assert_env_ok(env_cls, n_tasks=8)
    tasks = load_tasks(task_file)
    assert len(tasks["ood"]) == 30 and len(tasks["train"]) + len(tasks["heldout"]) == 60
    assert 0 < len(tasks["heldout"]) < 30  # about 20% of the unlabelled ones
    ood = env_cls.sample_tasks("ood", 5, seed=1)
    assert all(t.split == "ood" and t.id.startswith("big") and t.context == {"digits": 3} for t in ood)
    first = next(t for t in tasks["train"] + tasks["heldout"] if t.prompt == "What is 2 * 3?")
    assert env_cls.solve(first)[0].startswith("<tool_call>")
    assert env_cls.solve(ood[0]) == [f"<answer>{ood[0].answer}</answer>"]
    assert [t.name for t in env_cls().tools] == ["calculator"]


@pytest.mark.parametrize("verifier,given,gold,ok", [
    ("exact", "The Answer", "answer", True), ("exact", "42", "42.0", False), ("numeric", "42", "42.0", True),
    ("contains", "it is Paris, France", "paris", True), ("contains", "Rome", "paris", False)])
def test_verifiers(task_file, verifier, given, gold, ok):
    env_cls = JsonlToolsEnv.configure(data=str(task_file), verifier=verifier)
    env = env_cls()
    task = env_cls.sample_tasks("train", 1, seed=0)[0]
    task = type(task)(id="t", prompt="p", answer=gold)
    env.reset(task)
    result = asyncio.run(env.step(Message(role="assistant", content=f"<answer>{given}</answer>")))
    assert result.reward == (1.0 if ok else 0.0) and env.tools == []


def test_clear_errors(tmp_path, task_file):
    with pytest.raises(EnvError, match="set env.data"):
        JsonlToolsEnv.configure(data="")
    with pytest.raises(EnvError, match="does not exist"):
        JsonlToolsEnv.configure(data=str(tmp_path / "nope.jsonl"))
    with pytest.raises(EnvError, match="unknown tool 'search'"):
        JsonlToolsEnv.configure(data=str(task_file), tools="calculator, search")
    with pytest.raises(EnvError, match="unknown verifier 'fuzzy'"):
        JsonlToolsEnv.configure(data=str(task_file), verifier="fuzzy")
    bad = tmp_path / "bad.jsonl"
    for text, message in [('{"prompt": "p"}', 'bad.jsonl:1: each task needs a string "prompt" and an "answer"'),
                          ("{not json", "bad.jsonl:1: not JSON"),
                          ('{"prompt": "p", "answer": 1, "split": "test"}', "split 'test' is not one of"),
                          ('{"prompt": "p", "answer": 1, "solution": "x"}', '"solution" must be a list'),
                          ("\n\n", "holds no tasks")]:
        bad.write_text(text + "\n")
        with pytest.raises(EnvError, match=message):
            load_tasks(bad)
    only_train = tmp_path / "train.jsonl"
    only_train.write_text('{"prompt": "a", "answer": 1, "split": "train"}\n')
    with pytest.raises(EnvError, match="no 'ood' tasks; label some"):
        JsonlToolsEnv.configure(data=str(only_train)).sample_tasks("ood", 1, seed=0)
    with pytest.raises(EnvError, match="needs a task file"):
        JsonlToolsEnv()


def test_trains_through_the_loop(tmp_path, task_file):
    from ctxrl.config import load_config
    from ctxrl.train.trainer import Trainer

    config = load_config(None, ["model.name=tiny:pretrain_steps=0", "sft.enabled=false", "env.name=jsonl_tools",
                                f'env.data="{task_file}"', "env.tools=calculator", "env.verifier=numeric",
                                "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                                "run.progress=false", "eval.tasks=3"])
    run = Trainer(config, tmp_path / "run")
    run.make_learner()
    row = run.step(0)
    assert row["trained_episodes"] == 4
    assert set(run.evaluate(0)) == {"train", "heldout", "ood"}


def test_a_file_of_bare_prompt_answer_lines_checks_trains_and_evaluates_on_the_splits_it_has(tmp_path):
    """The documented minimum: no split labels, so no ood tasks. check-env passes with a note, and
    `ctxrl train` runs to its end, evaluating train and heldout and saying once that ood is skipped."""
    import os
    import subprocess
    import sys

    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"What is {a} plus {b}?", "answer": str(a + b)})
                              for a in range(10) for b in range(5)) + "\n")
    env_cls = configured_env_class("jsonl_tools", data=str(path), tools="calculator", verifier="numeric")
    assert env_cls.splits() == ("train", "heldout")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def ctxrl(*args):
        return subprocess.run([sys.executable, "-m", "ctxrl.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    check = ctxrl("check-env", "jsonl_tools", "--data", str(path), "--tools", "calculator", "--tasks", "4")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "OK" in check.stdout and "note: no 'ood' tasks: the ood split is skipped" in check.stdout
    config = Path(__file__).parents[1] / "examples" / "calculator_tiny.toml"
    run = ctxrl("train", str(config), "--steps", "1", "--json",
                "--run-dir", str(tmp_path / "run"), "model.name=tiny:pretrain_steps=0", "env.name=jsonl_tools",
                f'env.data="{path}"', "env.tools=calculator", "env.verifier=numeric", "sft.demos=4", "sft.epochs=1",
                "sft.batch_size=4", "eval.tasks=2", "rollout.tasks_per_step=2", "rollout.group_size=2",
                "rollout.max_new_tokens=8", "run.progress=false")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["ood_success_after"] is None and summary["heldout_success_after"] >= 0
    assert "ood" in run.stdout and "-" in run.stdout  # the table shows the skipped split as "-"
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_splits"] for r in rows if r["phase"] == "note"] == [["ood"]]  # reported once
    assert {r["split"] for r in rows if r["phase"] == "eval"} == {"train", "heldout"}
