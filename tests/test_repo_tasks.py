"""``repo_tasks`` and its sandboxed tree (``ctxrl.tools.shell``): the catalogue's bugs are real bugs, the gold
solutions pass ``check_env``, grading ignores the agent's copy of the tests, one task's ``run`` cannot reach another
task's tree or the host's files, a ``sleep 1e9`` and a fork bomb are cut at the deadline, and SWE-bench-style rows
load from a local git clone."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import pytest

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs import assert_env_ok
from ctxrl.envs.registry import configured_env_class
from ctxrl.envs.repo_bugs import OOD_KINDS, UNITS
from ctxrl.envs.repo_tasks import RepoTasksEnv, catalogue, count_tests, write_jsonl
from ctxrl.tools.sandbox import _workdir_base
from ctxrl.tools.shell import Tree, TreeError, apply_patch
from ctxrl.types import Message, ToolCall

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="a tree of its own uid needs root (docs/sandbox.md)")


def run_unittests(files: dict[str, str], where: Path) -> unittest.TestResult:
    """The files' tests, run in this process (the catalogue is ctxrl's own code, not the model's)."""
    where.mkdir(parents=True)
    for rel, text in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(text)
    tops = {Path(rel).parts[0].removesuffix(".py") for rel in files}  # ("pkg", "test_search", ...)
    taken = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in tops}
    sys.path.insert(0, str(where))
    try:
        suite = unittest.defaultTestLoader.discover(str(where), top_level_dir=str(where))
        return unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
    finally:
        sys.path.remove(str(where))
        for name in [name for name in sys.modules if name.split(".")[0] in tops]:
            del sys.modules[name]
        sys.modules.update(taken)  # (the suite's own test_search, say: put back as it was)


def test_every_bug_fails_a_test_that_the_correct_module_passes(tmp_path):
    correct = run_unittests({"pkg/__init__.py": "", **{f"pkg/{u.name}.py": u.source for u in UNITS},
                             **{f"test_{u.name}.py": u.tests for u in UNITS}}, tmp_path / "correct")
    assert correct.wasSuccessful() and correct.testsRun >= 3 * len(UNITS)
    sizes = {task.id: task for task in catalogue() if task.context["size"] == 1}
    assert len(sizes) == sum(len(u.bugs) for u in UNITS)
    for i, task in enumerate(sizes.values()):
        result = run_unittests(task.data["files"], tmp_path / f"bug{i}")
        assert not result.wasSuccessful(), task.context  # the bug is caught by a test


def test_the_catalogue_has_graded_splits():
    tasks = catalogue()
    assert len(tasks) >= 30
    by_split = {s: [t for t in tasks if t.split == s] for s in ("train", "heldout", "ood")}
    assert all(by_split.values())
    assert {t.context["size"] for t in by_split["train"]} == {1, 2}
    assert all(t.context["size"] >= 3 or t.context["kind"] in OOD_KINDS for t in by_split["ood"])
    assert not {t.context["module"] for t in by_split["train"]} & {t.context["module"] for t in by_split["heldout"]}
    easiest = configured_env_class("repo_tasks", {"max_size": 1})
    assert {t.context["size"] for t in easiest.sample_tasks("train", 30, 0)} == {1}
    assert len(set(t.id for t in easiest.sample_tasks("train", 100, 0))) == 21


def test_check_env_passes_and_the_gold_solution_is_what_a_model_writes():
    assert_env_ok(RepoTasksEnv, n_tasks=2)


def call(name: str, **arguments) -> Message:
    return Message("assistant", "", tool_calls=[ToolCall(name, arguments, "c")])


def play(env: RepoTasksEnv, *messages: Message) -> list:
    async def go():
        return [await env.step(m) for m in messages]
    return asyncio.run(go())


def test_grading_restores_the_tests_and_partial_credit_counts_them():
    task = next(t for t in catalogue() if t.split == "train" and t.context["size"] == 2)
    env = RepoTasksEnv()
    env.reset(task)
    test_file = task.data["tests"][0]
    steps = play(env, call("write_file", path=test_file, content="import unittest\n"),  # the tests deleted
                 call("run", command="python3 -m unittest -v"), Message("assistant", "done"))
    assert "Ran 0 tests" in steps[1].messages[0].content or "OK" in steps[1].messages[0].content
    assert steps[-1].terminated and steps[-1].reward == 0.0  # graded on the real tests
    passed, total = steps[-1].info["tests_passed"], steps[-1].info["tests_total"]
    assert 0 < passed < total
    env.close()
    partial = configured_env_class("repo_tasks", {"partial_credit": True})()
    partial.reset(task)
    last = play(partial, Message("assistant", "nothing to do"))[-1]
    assert last.reward == pytest.approx(passed / total)
    partial.close()


def test_patch_errors_are_observations_and_write_nothing():
    tree = Tree({"a.py": "x = 1\ny = 2\n"})
    try:
        bad = "--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n x = 9\n-y = 2\n+y = 3\n"
        with pytest.raises(TreeError, match="hunk 1 of a.py does not apply"):
            apply_patch(tree, bad)
        assert tree.read("a.py") == "x = 1\ny = 2\n"
        assert apply_patch(tree, "--- /dev/null\n+++ b/new/b.py\n@@ -0,0 +1 @@\n+z = 1\n") == ["new/b.py"]
        assert tree.read("new/b.py") == "z = 1\n"
        for path in ("../x", "/etc/passwd", ""):
            with pytest.raises(TreeError):
                tree.read(path)
    finally:
        tree.close()
    env = RepoTasksEnv()
    env.reset(catalogue()[0])
    step = play(env, call("apply_patch", patch="not a diff"), call("read_file", path="../../etc/passwd"))
    assert step[0].messages[0].content.startswith("Error: no file in the patch")
    assert step[1].messages[0].content.startswith("Error: '../../etc/passwd' is outside the repository")
    env.close()


@ROOT_ONLY
def test_a_run_cannot_reach_another_tree_or_the_host():
    mine, other = RepoTasksEnv(), RepoTasksEnv()
    tasks = catalogue()
    mine.reset(tasks[0])
    other.reset(tasks[5])
    host_dir = Path(tempfile.mkdtemp(dir=_workdir_base()))  # (not under /tmp: a run's /tmp is its own, empty)
    host_file = host_dir / "host.txt"
    host_file.write_text("host")
    os.chmod(host_dir, 0o700)
    theirs = other.tree.path
    probe = (f"cat {theirs}/pkg/__init__.py; ls {theirs}; echo x > {theirs}/pkg/evil.py; cat {host_file}; "
             f"echo y > {host_file}; echo z > /etc/ctxrl-probe; ln -s {theirs} link; echo end")
    out = play(mine, call("run", command=probe))[0].messages[0].content
    assert out.count("Permission denied") >= 5 and "end" in out, out
    assert host_file.read_text() == "host" and not Path("/etc/ctxrl-probe").exists()
    assert not (theirs / "pkg" / "evil.py").exists()
    # ctxrl itself never follows the model's link out of the tree
    follow = play(mine, call("read_file", path="link/pkg/__init__.py"),
                  call("write_file", path="link/x.py", content=""))
    assert all(s.messages[0].content.startswith("Error:") for s in follow)
    assert not (theirs / "x.py").exists()
    mine.close()
    other.close()
    shutil.rmtree(host_dir)
    assert not theirs.exists()


def test_a_hang_and_a_fork_bomb_are_cut_at_the_deadline():
    env = configured_env_class("repo_tasks", {"run_timeout_s": 1.0})()
    env.reset(catalogue()[0])
    for command in ("sleep 1e9", "bomb() { bomb | bomb & }; bomb; sleep 1e9"):
        start = time.monotonic()
        out = play(env, call("run", command=command))[0].messages[0].content
        assert time.monotonic() - start < 8, command
        assert "timed out after" in out, out
    assert play(env, call("run", command="echo alive"))[0].messages[0].content.startswith("alive")
    env.close()


def test_count_tests_reads_unittest_and_pytest():
    unit = ("test_a (test_x.T.test_a) ... ok\ntest_b (test_x.T.test_b) ... FAIL\n"
            "test_c (test_x.T.test_c) ... skipped 'x'")
    assert count_tests(unit) == (1, 2)
    assert count_tests("PASSED t.py::a\nFAILED t.py::b - x\nPASSED t.py::c") == (2, 3)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def test_swe_bench_rows_load_from_a_local_clone_and_jsonl_round_trips(tmp_path):
    clone = tmp_path / "repos" / "acme__calc"
    clone.mkdir(parents=True)
    git(clone, "init", "-q")
    (clone / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (clone / "test_calc.py").write_text("import unittest\n")
    git(clone, "add", ".")
    git(clone, "commit", "-qm", "buggy")
    base = git(clone, "rev-parse", "HEAD").strip()
    (clone / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    patch = git(clone, "diff")
    git(clone, "checkout", "-q", "calc.py")
    (clone / "test_calc.py").write_text("import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
                                        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    test_patch = git(clone, "diff")
    git(clone, "checkout", "-q", "test_calc.py")
    row = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base, "patch": patch,
           "test_patch": test_patch, "problem_statement": "add() subtracts.",
           "FAIL_TO_PASS": '["test_calc.T.test_add"]', "PASS_TO_PASS": "[]",
           "test_command": "python3 -m unittest -v test_calc", "split": "train"}
    missing = {**row, "instance_id": "other-1", "repo": "acme/elsewhere"}
    data = tmp_path / "swe.jsonl"
    data.write_text(json.dumps(row) + "\n" + json.dumps(missing) + "\n")
    env_cls = configured_env_class("repo_tasks", {"data": str(data), "repos": str(tmp_path / "repos")})
    [task] = env_cls.sample_tasks("train", 1, 0)
    assert task.id == "acme__calc-1" and env_cls.splits() == ("train",)
    env = env_cls()
    env.reset(task)
    assert play(env, Message("assistant", "nothing"))[-1].reward == 0.0  # the hidden test fails on the bug
    env.reset(task)
    turns = [call("apply_patch", patch=patch), Message("assistant", "fixed")]
    assert play(env, *turns)[-1].reward == 1.0
    env.close()
    assert format_tool_call("apply_patch", {"patch": patch}) in env_cls.solve(task)
    # and repo_tasks' own rows: the catalogue written as JSONL plays as the catalogue does
    own = tmp_path / "own.jsonl"
    write_jsonl(str(own), [t for t in catalogue() if t.context["size"] == 1][:3])
    own_cls = configured_env_class("repo_tasks", {"data": str(own)})
    first = own_cls.sample_tasks(own_cls.splits()[0], 1, 0)[0]
    env = own_cls()
    env.reset(first)
    assert play(env, call("apply_patch", patch=first.data["patch"]), Message("assistant", "ok"))[-1].reward == 1.0
    env.close()
