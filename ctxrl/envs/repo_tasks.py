"""The ``repo_tasks`` environment: fix a bug in a small repository until its tests pass, working in the sandbox.

A task is a repository (its files), a goal and a test command. The agent gets the tools a coding agent has
(``ctxrl.tools.shell``): ``read_file``, ``write_file``, ``apply_patch`` (a unified diff) and ``run`` (a shell command
in the sandbox's namespaces, the repository as its working tree, under a deadline and output caps). A turn without a
tool call ends the episode, and the tests decide its reward: 1.0 when the test command exits 0, else 0.0, or, with
``partial_credit``, the share of the tests that passed (read from ``unittest -v`` or ``pytest -rA`` output).

Grading never trusts the agent's copy of the tests: it runs in a fresh tree holding the task's files, with the
agent's versions of the task's files that are not tests laid over them (files the agent created are left out), or,
for a SWE-bench row, the agent's whole tree with the row's ``test_patch`` applied over the files it touches. (Code
the agent wrote that patches the test runner at import time is not prevented, as it is not in SWE-bench.)

Where the tasks come from (``[env.repo_tasks]``):

- by default, the generated catalogue (``ctxrl.envs.repo_bugs``): a package ``pkg`` of ``size`` modules with
  ``unittest`` tests, one module holding one bug. Train and held-out tasks have sizes 1 to ``max_size`` (2) and
  the bug kinds ``off_by_one``, ``wrong_operator``, ``wrong_comparison``, ``wrong_value``; held-out tasks are
  the bugs of two modules never trained on (``HELDOUT_UNITS``: ``dates``, ``grid``). OOD tasks are larger (sizes 3
  and 4) or of kinds never trained on (``missing_guard``, ``swapped_args``; context ``new_kind = 1``).
  ``max_size = 1`` is the easiest split: one module, the bug in it;
- ``data = "tasks.jsonl"``: one task a line, ``{"goal", "files": {path: text}, "test_command", "tests": [paths
  grading restores], "patch": the gold fix as a unified diff (optional: for solve), "split": "train" | "heldout" |
  "ood" (optional: else a stable 20 % are held out)}``, or a folder of tasks, each a folder with ``task.json`` (the
  same, without ``files``) and ``repo/`` (the files);
- ``data = "swe.jsonl"`` with SWE-bench rows (``instance_id``, ``repo``, ``base_commit``, ``problem_statement``,
  ``patch``, ``test_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``) and ``repos = "path/to/clones"``: a row is played
  when its repository is a local git clone there (``owner__name`` or ``owner/name``); the tree is ``git archive`` of
  ``base_commit``; the test command is the row's ``test_command``, else ``python3 -m pytest -rA`` over its
  ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` tests (what the sandbox's interpreter can import is what it has). Rows
  whose repository is not local are left out (and counted in the error when none is).

The gold ``solve`` (warm-start demos, ``check-env``) reads the buggy file, applies the fix as a patch, runs the tests
and stops.
"""

from __future__ import annotations

import difflib
import functools
import io
import json
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.repo_bugs import HELDOUT_UNITS, KINDS, OOD_KINDS, UNITS, Unit
from ctxrl.tasks.space import ContextParam, ContextSpace, split_of, stable_hash, task_id
from ctxrl.tools.base import Tool, execute_tool_calls
from ctxrl.tools.shell import Tree, TreeError, apply_patch, tree_tools
from ctxrl.types import SPLITS, Message, StepResult, Task

TEST_COMMAND = "python3 -m unittest -v"
SIZES = (1, 2, 3, 4)
TRAIN_MAX_SIZE = 2


@dataclass(frozen=True)
class Settings:
    """The table ``[env.repo_tasks]``."""

    data: str = ""
    """Tasks from a JSONL file (repo_tasks' own rows, or SWE-bench rows) or a folder of task folders; empty: the
    generated catalogue."""
    repos: str = ""
    """For SWE-bench rows: the folder of local git clones (``owner__name`` or ``owner/name``)."""
    max_size: int = TRAIN_MAX_SIZE
    """The generated catalogue's largest repository (modules) in train and held-out tasks: 1 is the easiest split
    (the bug in the only module), 2 the default; OOD tasks are sizes 3 and 4 and unseen kinds whatever it is."""
    partial_credit: bool = False
    """Reward the share of tests that passed, not all-or-nothing."""
    run_timeout_s: float = 20.0
    """Deadline of one ``run`` (and of grading's test run)."""
    heldout_fraction: float = 0.2
    """For ``data`` rows without a split: the share held out (by a stable hash of the goal)."""

    def __post_init__(self) -> None:
        if self.max_size not in (1, 2):
            raise ValueError(f"max_size must be 1 or 2 (sizes 3 and 4 are the OOD split), got {self.max_size}")
        if not self.run_timeout_s > 0:
            raise ValueError(f"run_timeout_s must be > 0, got {self.run_timeout_s}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


# -- the generated catalogue --------------------------------------------------------------------------------------
def _files(units: list[Unit], buggy: str | None = None, source: str | None = None) -> dict[str, str]:
    files = {"pkg/__init__.py": ""}
    for unit in units:
        files[f"pkg/{unit.name}.py"] = source if unit.name == buggy else unit.source
        files[f"test_{unit.name}.py"] = unit.tests
    return files


def _diff(path: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        f"a/{path}", f"b/{path}"))


def _goal(files: dict[str, str]) -> str:
    listing = "\n".join(f"- {p}" for p in sorted(files) if p != "pkg/__init__.py")
    return (f"The repository holds the package pkg and its tests:\n{listing}\n\nSome tests fail: `{TEST_COMMAND}` "
            "shows which. Find the bug in pkg and fix it without changing the tests.")


@functools.cache
def catalogue() -> tuple[Task, ...]:
    """Every generated task (see the module docstring): each bug of each unit, at each size."""
    tasks = []
    for u, unit in enumerate(UNITS):
        for b, (kind, correct, wrong) in enumerate(unit.bugs):
            if unit.source.count(correct) != 1:
                raise EnvError(f"repo_bugs: {unit.name}'s bug {b} must replace text found once in the module")
            buggy = unit.source.replace(correct, wrong)
            module_split = "heldout" if unit.name in HELDOUT_UNITS else "train"
            for size in SIZES:
                units = [UNITS[(u + k) % len(UNITS)] for k in range(size)]
                files = _files(units, unit.name, buggy)
                path = f"pkg/{unit.name}.py"
                split = "ood" if size > TRAIN_MAX_SIZE or kind in OOD_KINDS else module_split
                data = {"files": files, "tests": [f"test_{x.name}.py" for x in units], "test_command": TEST_COMMAND,
                        "patch": _diff(path, buggy, unit.source), "target": path}
                goal = _goal(files)
                tasks.append(Task(id=task_id("repo", goal, data=data), prompt=goal, answer="the tests pass",
                                  context={"size": size, "new_kind": int(kind in OOD_KINDS), "kind": kind,
                                           "module": unit.name}, split=split, data=data))
    return tuple(tasks)


# -- tasks from files ---------------------------------------------------------------------------------------------
def _split(row: dict, key: str, heldout_fraction: float) -> str:
    split = row.get("split")
    if split is not None and split not in SPLITS:
        raise EnvError(f"repo_tasks: a task's split must be one of {SPLITS}, got {split!r}")
    return split or split_of(key, heldout_fraction)


def _listify(value: Any) -> list[str]:
    if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith("[") else [value] if value else []
    return [str(v) for v in value or []]


def _clone(repos: str, name: str) -> Path | None:
    for candidate in (Path(repos) / name.replace("/", "__"), Path(repos) / name):
        if (candidate / ".git").exists() or (candidate / "HEAD").is_file():
            return candidate
    return None


def _swe_task(row: dict, settings: Settings) -> Task | None:
    """A SWE-bench row as a task, or None when its repository is not a local clone."""
    clone = _clone(settings.repos, str(row["repo"])) if settings.repos else None
    if clone is None:
        return None
    tests = _listify(row.get("FAIL_TO_PASS")) + _listify(row.get("PASS_TO_PASS"))
    command = row.get("test_command") or "python3 -m pytest -rA " + " ".join(f"'{t}'" for t in tests)
    data = {"clone": str(clone), "commit": str(row["base_commit"]), "test_patch": str(row.get("test_patch", "")),
            "patch": str(row.get("patch", "")), "test_command": str(command)}
    goal = str(row.get("problem_statement", "")).strip() + (f"\n\nThe tests run with `{command}`.")
    return Task(id=str(row.get("instance_id") or task_id("swe", goal, data=data)), prompt=goal, answer="the tests pass",
                context={"repo": str(row["repo"])}, split=_split(row, goal, settings.heldout_fraction), data=data)


def _own_task(row: dict, settings: Settings, where: str) -> Task:
    for key in ("goal", "files", "test_command"):
        if key not in row:
            raise EnvError(f"repo_tasks: {where} has no {key!r} (a task is goal, files, test_command, tests)")
    if not isinstance(row["files"], dict) or not all(isinstance(v, str) for v in row["files"].values()):
        raise EnvError(f"repo_tasks: {where}'s files must be an object of path -> text")
    data = {"files": row["files"], "tests": _listify(row.get("tests")), "test_command": str(row["test_command"]),
            "patch": str(row.get("patch", ""))}
    goal = str(row["goal"])
    return Task(id=str(row.get("id") or task_id("repo", goal, data=data)), prompt=goal, answer="the tests pass",
                context=dict(row.get("context") or {}), split=_split(row, goal, settings.heldout_fraction), data=data)


@functools.cache
def load_tasks(settings: Settings) -> tuple[Task, ...]:
    """The tasks ``settings.data`` names (module docstring)."""
    path = Path(settings.data)
    if path.is_dir():
        tasks = []
        for folder in sorted(p for p in path.iterdir() if (p / "task.json").is_file()):
            row = json.loads((folder / "task.json").read_text())
            repo = folder / "repo"
            row["files"] = {str(f.relative_to(repo)): f.read_text() for f in sorted(repo.rglob("*")) if f.is_file()}
            tasks.append(_own_task(row, settings, str(folder)))
        if not tasks:
            raise EnvError(f"repo_tasks: the folder {path} holds no task folders (each has task.json and repo/)")
        return tuple(tasks)
    if not path.is_file():
        raise EnvError(f"repo_tasks: data = {settings.data!r} is neither a JSONL file nor a folder of tasks")
    tasks, remote = [], []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "base_commit" in row:
            task = _swe_task(row, settings)
            if task is None:
                remote.append(str(row.get("repo")))
            else:
                tasks.append(task)
        else:
            tasks.append(_own_task(row, settings, f"{path}:{n}"))
    if not tasks:
        raise EnvError(f"repo_tasks: none of the {len(remote)} rows of {path} has its repository as a local clone in "
                       f"repos = {settings.repos!r} (needed: {', '.join(sorted(set(remote))[:5])})")
    return tuple(tasks)


# -- grading --------------------------------------------------------------------------------------------------------
_UNITTEST = re.compile(r"^(\S+) \((\S+)\)(?:\n.*?)?\s\.\.\. (ok|FAIL|ERROR|skipped|expected failure|unexpected "
                       r"success)", re.MULTILINE)
_PYTEST = re.compile(r"^(PASSED|FAILED|ERROR) (\S+)", re.MULTILINE)


def count_tests(output: str) -> tuple[int, int]:
    """``(passed, total)`` from ``unittest -v`` or ``pytest -rA`` output (skipped tests count as neither)."""
    outcomes = [m.group(3) for m in _UNITTEST.finditer(output) if not m.group(3).startswith("skipped")]
    if outcomes:
        return sum(o in ("ok", "expected failure") for o in outcomes), len(outcomes)
    found = {m.group(2): m.group(1) for m in _PYTEST.finditer(output)}
    return sum(o == "PASSED" for o in found.values()), len(found)


def _archive(tree: Tree, clone: str, commit: str) -> None:
    done = subprocess.run(["git", "-C", clone, "archive", "--format=tar", commit], capture_output=True, timeout=300)
    if done.returncode != 0:
        raise EnvError(f"repo_tasks: git archive {commit} in {clone} failed: {done.stderr.decode()[-300:]}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(tree.path, filter="data")
    tree._own(tree.path)


def _base_file(clone: str, commit: str, path: str) -> str | None:
    done = subprocess.run(["git", "-C", clone, "show", f"{commit}:{path}"], capture_output=True, timeout=60)
    return done.stdout.decode("utf-8", errors="replace") if done.returncode == 0 else None


def checkout(task: Task) -> Tree:
    """The task's repository as a fresh tree."""
    if "files" in task.data:
        return Tree(task.data["files"])
    tree = Tree({})
    try:
        _archive(tree, task.data["clone"], task.data["commit"])
    except BaseException:
        tree.close()
        raise
    return tree


def grading_tree(task: Task, worked: Tree) -> Tree:
    """The tree the tests are run in (module docstring): never the agent's own tests."""
    if "files" in task.data:
        original = task.data["files"]
        tests = set(task.data.get("tests") or ())
        now = worked.files()
        return Tree({path: now.get(path, text) if path not in tests else text for path, text in original.items()})
    tree = Tree({})
    try:
        shutil.copytree(worked.path, tree.path, symlinks=True, dirs_exist_ok=True)
        tree._own(tree.path)
        test_patch = task.data.get("test_patch") or ""
        if test_patch:
            from ctxrl.tools.shell import parse_patch

            for old, new, _ in parse_patch(test_patch):
                for path in {p for p in (old, new) if p}:
                    base = _base_file(task.data["clone"], task.data["commit"], path)
                    if base is None:
                        if (tree.path / path).exists():
                            tree.delete(path)
                    else:
                        tree.write(path, base)
            apply_patch(tree, test_patch)
    except BaseException:
        tree.close()
        raise
    return tree


# -- the environment ------------------------------------------------------------------------------------------------
@register("repo_tasks")
class RepoTasksEnv:
    """Fix a small repository until its tests pass, with file and shell tools in the sandbox (module docstring)."""

    name: ClassVar[str] = "repo_tasks"
    system_prompt: ClassVar[str] = (
        "You fix bugs in a repository with the tools read_file, write_file, apply_patch and run (a shell command in "
        "the repository). Run the tests, read the code, fix it (never the tests), run the tests again, then reply "
        "with a short summary and no tool call: that ends the task, and the tests decide it.")
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("size", "int", low=1, high=TRAIN_MAX_SIZE, default=1, ood_low=1, ood_high=4,
                     description="modules in the package (more files to read); OOD: 3 and 4, or a new kind"),
        ContextParam("new_kind", "int", low=0, high=0, default=0, ood_low=0, ood_high=1,
                     description="1: a kind of bug never trained on (OOD only)"),
        ContextParam("kind", "choice", choices=KINDS, default="off_by_one",
                     description="the kind of bug (missing_guard, swapped_args: OOD only)"),
        ContextParam("module", "choice", choices=tuple(u.name for u in UNITS), default=UNITS[0].name,
                     description=f"the module with the bug ({', '.join(HELDOUT_UNITS)}: held out)"),
    ])
    Settings: ClassVar[type] = Settings
    options: ClassVar[Settings] = Settings()

    @classmethod
    def tasks(cls) -> tuple[Task, ...]:
        opts = cls.options
        if opts.data:
            return load_tasks(opts)
        return tuple(t for t in catalogue()
                     if t.split == "ood" or t.context["size"] <= opts.max_size)

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if any(t.split == s for t in cls.tasks()))

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split``: the split's tasks shuffled by ``seed``, cycled when ``n`` is larger."""
        pool = [t for t in cls.tasks() if t.split == split]
        if not pool:
            raise EnvError(f"repo_tasks has no {split!r} tasks (it has {', '.join(cls.splits())})")
        order = sorted(pool, key=lambda t: stable_hash(f"{seed}:{t.id}"))
        return [order[i % len(order)] for i in range(n)]

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Read the buggy file, apply the gold fix, run the tests, stop."""
        patch = task.data.get("patch")
        if not patch:
            raise EnvError(f"repo_tasks: task {task.id} has no gold patch, so it cannot be solved by script")
        turns = [format_tool_call("read_file", {"path": task.data["target"]})] if task.data.get("target") else []
        return turns + [format_tool_call("apply_patch", {"patch": patch}),
                        format_tool_call("run", {"command": task.data["test_command"]}),
                        "I fixed the bug; the tests pass."]

    def __init__(self) -> None:
        self.tree: Tree | None = None
        self.task: Task | None = None
        self.done = False
        self.tools: list[Tool] = tree_tools(lambda: self.tree, run_timeout_s=self.options.run_timeout_s)

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        self.close()
        if "files" not in task.data and "clone" not in task.data:
            raise EnvError(f"task {task.id} has no repository (data['files'] or a clone); draw repo_tasks tasks "
                           "with sample_tasks")
        self.task, self.tree, self.done = task, checkout(task), False
        return [Message("system", self.system_prompt), Message("user", task.prompt)]

    async def step(self, message: Message) -> StepResult:
        if self.task is None:
            raise EnvError("step() called before reset(task); start an episode with reset first")
        if self.done:
            raise EnvError("step() called after the episode terminated; call reset(task) to start a new episode")
        if message.tool_calls or message.tool_call_errors:
            observations, counts = await execute_tool_calls(self.tools, message)
            return StepResult(messages=observations, reward=0.0, terminated=False, info=counts)
        self.done = True
        passed, total, ok = await self.grade()
        reward = 1.0 if ok else (passed / total if self.options.partial_credit and total else 0.0)
        return StepResult(messages=[], reward=reward, terminated=True,
                          info={"tests_passed": passed, "tests_total": total, "correct": ok, "answered": True})

    async def grade(self) -> tuple[int, int, bool]:
        """``(tests passed, tests run, all passed)``: the task's test command in the grading tree."""
        try:
            tree = grading_tree(self.task, self.tree)
        except TreeError:
            return 0, 0, False
        try:
            result = await tree.run(self.task.data["test_command"], timeout_s=self.options.run_timeout_s,
                                    max_output_bytes=65536)
        finally:
            tree.close()
        passed, total = count_tests(result.stdout + "\n" + result.stderr)
        return passed, total, result.ok

    def close(self) -> None:
        if self.tree is not None:
            self.tree.close()
        self.tree, self.task = None, None


def write_jsonl(path: str, tasks: list[Task]) -> None:
    """Write tasks as repo_tasks rows (``data = PATH`` loads them back): the generated catalogue, for one."""
    with open(path, "w") as f:
        for task in tasks:
            row = {"id": task.id, "goal": task.prompt, "split": task.split, "context": task.context,
                   **{k: task.data[k] for k in ("files", "tests", "test_command", "patch")}}
            f.write(json.dumps(row) + "\n")
