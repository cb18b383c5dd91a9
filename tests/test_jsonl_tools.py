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
    for text, message in [('{"prompt": "p"}', 'bad.jsonl:1: the task has no "answer"'),
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
    from ctxrl.run import loop
    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step

    config = load_config(None, ["model.name=tiny:pretrain_steps=0", "sft.enabled=false", "env.name=jsonl_tools",
                                f'env.data="{task_file}"', "env.jsonl_tools.tools=calculator",
                                "env.jsonl_tools.verifier=numeric",
                                "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                                "run.progress=false", "eval.tasks=3"])
    run = build(config, tmp_path / "run")
    start_learning(run)
    row = rl_step(run, 0)
    assert row["trained_episodes"] == 4
    assert set(loop.evaluate(run, 0)) == {"train", "heldout", "ood"}


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
                f'env.data="{path}"', "env.jsonl_tools.tools=calculator", "env.jsonl_tools.verifier=numeric",
                "sft.demos=4", "sft.epochs=1",
                "sft.batch_size=4", "eval.tasks=2", "rollout.tasks_per_step=2", "rollout.group_size=2",
                "rollout.max_new_tokens=8", "run.progress=false")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["ood_success_after"] is None and summary["heldout_success_after"] >= 0
    assert "ood" in run.stdout and "-" in run.stdout  # the table shows the skipped split as "-"
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_splits"] for r in rows if r["phase"] == "note"] == [["ood"]]  # reported once
    assert {r["split"] for r in rows if r["phase"] == "eval"} == {"train", "heldout"}


# -- task files that cannot be trained on (issue 33, item 5): one line naming the file, the line and the fix ---------
GOOD = '{"prompt": "What is 2 + 2?", "answer": "4"}'
EXAMPLE = str(Path(__file__).parents[1] / "examples" / "calculator_tiny.toml")
BAD_LINES = [  # (the second line of the file, what the error says)
    (b'{"prompt": "caf\xe9?", "answer": "1"}', r'bad\.jsonl:2: not UTF-8 \(byte b.\\xe9. at column 16\); save the task '
                                               r'file as UTF-8'),
    ('{"prompt": "p", "answer": "1", "context": "level 3"}', r'bad\.jsonl:2: "context" must be an object of labels '
                                                             r'such as \{"level": 3\}, got a string'),
    ('{"prompt": "p", "answer": "1", "context": [1]}', '"context" must be an object .* got a list'),
    ('{"prompt": "p", "answer": ""}', '"answer" is empty: the exact and contains verifiers would take any reply'),
    ('{"prompt": "p", "answer": "  "}', '"answer" is empty'),
    ('{"prompt": "p", "answer": null}', '"answer" is null, which no reply can match'),
    ('{"prompt": "p", "answer": "The"}', "is empty once the exact verifier normalises it"),
    ('{"prompt": "p", "answer": ["4"]}', '"answer" must be a string or a number, got a list'),
    ('{"prompt": "p", "answer": true}', '"answer" must be a string or a number, got a boolean'),
    ('{"prompt": "p", "answer": NaN}', '"answer" is nan'),
    ('{"prompt": 7, "answer": "1"}', '"prompt" must be a non-empty string, got a number'),
    ('{"prompt": "", "answer": "1"}', '"prompt" must be a non-empty string, got an empty one'),
    ('{"answer": "1"}', 'the task has no "prompt"'),
    ('["p", "1"]', "a task is a JSON object .* not a list"),
    ('{"prompt": "p", "answer": "1", "id": {"n": 1}}', '"id" must be a string or an integer, got an object'),
    ('{"prompt": "p", "answer": "1", "solution": ["a", 2]}', '"solution" must be a list .* holding other values'),
    ("[" * 100_000, "bad\\.jsonl:2: (not JSON|JSON nested too deep)"),
]


def _bad_file(tmp_path: Path, second: str | bytes) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + (second if isinstance(second, bytes) else second.encode()) + b"\n")
    return path


@pytest.mark.parametrize("second,message", BAD_LINES, ids=range(len(BAD_LINES)))
def test_a_bad_task_line_is_one_error_naming_file_line_and_fix(tmp_path, second, message):
    path = _bad_file(tmp_path, second)
    with pytest.raises(EnvError, match=message) as caught:
        JsonlToolsEnv.configure(data=str(path))
    assert str(caught.value).startswith(f"{path}:2: ") and "\n" not in str(caught.value)


@pytest.mark.parametrize("second,message", [BAD_LINES[0], BAD_LINES[1], BAD_LINES[3], BAD_LINES[5]])
def test_ctxrl_config_reports_a_bad_task_file_in_one_line(tmp_path, capsys, second, message):
    import re

    from ctxrl.cli import main

    path = _bad_file(tmp_path, second)
    assert main(["config", EXAMPLE, "env.name=jsonl_tools", f'env.data="{path}"']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"ctxrl: environment error: {path}:2: ")
    assert re.search(message, err)


def test_a_byte_order_mark_and_numbers_are_fine(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b'\n{"prompt": "p", "answer": 391, "id": 0, "context": null}\n')
    tasks = [t for split in load_tasks(path).values() for t in split]
    assert sorted(t.answer for t in tasks) == ["391", "4"] and "0" in {t.id for t in tasks}


def test_a_prompt_too_long_for_the_rollout_is_refused_before_anything_loads(tmp_path, capsys, renderer):
    """A 300 KB prompt made the warm start try to allocate 90 GB: now ``ctxrl config`` refuses it by characters,
    and a rollout worker, which has the model's tokenizer, by tokens."""
    from ctxrl.cli import main
    from ctxrl.config import load_config
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import RolloutWorker, spec_env_class

    path = _bad_file(tmp_path, json.dumps({"prompt": "x" * 300_000, "answer": "1"}))
    assert main(["config", EXAMPLE, "env.name=jsonl_tools", f'env.data="{path}"']) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"ctxrl: environment error: {path}:2: the prompt is 300000 characters, more than "
                   "rollout.max_total_tokens = 512 tokens can hold (no tokenizer packs 16 characters into a token); "
                   "shorten the prompt, drop the task, or raise rollout.max_total_tokens")
    # within the characters' bound, beyond the tokens': the worker counts them with the model's tokenizer
    prompt = " ".join(f"{i:x}" for i in range(700))  # about 2 700 characters, well over 1 000 tokens
    path = _bad_file(tmp_path, json.dumps({"prompt": prompt, "answer": "1"}))
    spec = RolloutSpec.from_config(load_config(None, ["env.name=jsonl_tools", f'env.data="{path}"',
                                                      "rollout.max_total_tokens=1000"]))
    env_cls = spec_env_class(spec)  # the characters pass
    with pytest.raises(EnvError, match=rf"{path}:2: the prompt takes \d+ tokens of the model's tokenizer, and "
                                       "rollout.max_total_tokens = 1000 must hold the whole episode"):
        RolloutWorker(spec, engine=None, renderer=renderer, env_cls=env_cls)
    env_cls.check_tasks(4000, lambda text: len(renderer.encode_plain(text)))  # room enough: no error
