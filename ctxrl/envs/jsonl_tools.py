"""``jsonl_tools``: train on your own tasks without writing an environment class.

A JSONL file holds one task per line::

    {"prompt": "What is 17 * 23?", "answer": "391"}
    {"prompt": "...", "answer": "...", "id": "q7", "split": "ood", "context": {"level": 3},
     "solution": ["<tool_call>...</tool_call>", "<answer>...</answer>"]}

``prompt`` and ``answer`` are required. ``split`` (``train``, ``heldout`` or ``ood``) is optional:
unlabelled tasks go to ``train`` or ``heldout`` by a stable hash of the prompt (20% held out);
``ood`` exists only for labelled tasks: a file without it trains and evaluates on the splits it
has (``splits()``), and the missing one is reported once as skipped. ``solution`` (assistant
texts) is what ``solve()`` plays; without it ``solve()`` answers directly. The episode has the
``ToolAnswerEnv`` shape: tool turns get observations, the first turn without a call is the scored
answer.

Configuration (``[env]``): ``name = "jsonl_tools"``, ``data`` (the file), ``tools`` (comma-
separated built-in tools: ``calculator``, ``python``) and ``verifier`` (``exact``: equal after
SQuAD normalisation; ``numeric``: equal as numbers, via sympy; ``contains``: the normalised gold
appears in the normalised answer). ``JsonlToolsEnv.configure(data=..., tools=..., verifier=...)``
returns the environment class bound to them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextSpace, split_of, task_id
from ctxrl.tools.base import Tool
from ctxrl.types import SPLITS, Task


def _tool(name: str) -> Tool:
    if name == "calculator":
        from ctxrl.tools.calculator import calculator_tool

        return calculator_tool()
    if name == "python":
        from ctxrl.tools.python import python_tool

        return python_tool()
    raise EnvError(f"jsonl_tools: unknown tool {name!r}; built-in tools are calculator, python")


def _verifier(name: str) -> Callable[[str, str], bool]:
    from ctxrl.tools.search import exact_match, normalize_answer

    if name == "exact":
        return exact_match
    if name == "numeric":
        from ctxrl.envs.python_math import answers_equivalent

        return answers_equivalent
    if name == "contains":
        return lambda given, gold: normalize_answer(gold) in normalize_answer(given)
    raise EnvError(f"jsonl_tools: unknown verifier {name!r}; choose exact, numeric or contains")


def load_tasks(path: str | Path, heldout_fraction: float = 0.2) -> dict[str, list[Task]]:
    """Tasks of a JSONL file by split; every problem names the file and line."""
    if not str(path):
        raise EnvError("jsonl_tools needs a task file: set env.data to a JSONL file (check-env: --data FILE)")
    path = Path(path)
    if not path.is_file():
        raise EnvError(f"jsonl_tools: task file {str(path)!r} does not exist or is not a file "
                       "(set env.data to a JSONL file)")
    by_split: dict[str, list[Task]] = {s: [] for s in SPLITS}
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EnvError(f"{where}: not JSON ({exc.msg}); one task object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
                raise EnvError(f'{where}: each task needs a string "prompt" and an "answer"')
            split = row.get("split") or split_of(row["prompt"], heldout_fraction)
            if split not in SPLITS:
                raise EnvError(f"{where}: split {split!r} is not one of {', '.join(SPLITS)}")
            solution = row.get("solution")
            if solution is not None and (not isinstance(solution, list)
                                         or not all(isinstance(t, str) for t in solution)):
                raise EnvError(f'{where}: "solution" must be a list of assistant texts')
            by_split[split].append(Task(id=str(row.get("id") or task_id("jsonl", row["prompt"])), prompt=row["prompt"],
                                        answer=str(row["answer"]), context=dict(row.get("context") or {}),
                                        split=split, data={"solution": solution} if solution else {}))
    if not any(by_split.values()):
        raise EnvError(f"jsonl_tools: {path} holds no tasks")
    return by_split


def _observed_space(tasks: dict[str, list[Task]]) -> ContextSpace:
    """The context labels the file uses, as choice params (a task without a label gets None)."""
    from ctxrl.tasks.space import ContextParam

    every = [t for split in tasks.values() for t in split]
    keys = sorted({k for t in every for k in t.context})
    for t in every:
        for k in keys:
            t.context.setdefault(k, None)
    params = []
    for k in keys:
        values = sorted({json.dumps(t.context[k], sort_keys=True) for t in every})
        params.append(ContextParam(k, "choice", choices=tuple(json.loads(v) for v in values),
                                   description="label from the task file"))
    return ContextSpace(params)


@register("jsonl_tools")
class JsonlToolsEnv(ToolAnswerEnv):
    """Tasks from a JSONL file, built-in tools by name, a named verifier (see the module docstring)."""

    name: ClassVar[str] = "jsonl_tools"
    system_prompt: ClassVar[str] = "Use the tools if they help. Reply with <answer>ANSWER</answer>."
    context_space: ClassVar[ContextSpace] = ContextSpace([])
    tasks: ClassVar[dict[str, list[Task]]] = {}
    tool_names: ClassVar[tuple[str, ...]] = ()
    verify: ClassVar[Callable[[str, str], bool] | None] = None

    @classmethod
    def configure(cls, *, data: str, tools: str = "", verifier: str = "exact", **_: Any) -> type:
        """A subclass bound to a task file, tools and verifier (checked now, not mid-rollout)."""
        names = tuple(t.strip() for t in tools.split(",") if t.strip())
        for n in names:
            _tool(n)
        verify = _verifier(verifier)
        tasks = load_tasks(data)
        return type(cls.__name__, (cls,), {"tasks": tasks, "tool_names": names, "verify": staticmethod(verify),
                                          "context_space": _observed_space(tasks)})

    def __init__(self) -> None:
        if self.verify is None:
            raise EnvError("jsonl_tools needs a task file: set env.data (and env.tools, env.verifier) in the config")
        super().__init__()

    def make_tools(self) -> list[Tool]:
        return [_tool(n) for n in self.tool_names]

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        """The splits the task file has tasks for (a file of bare prompt/answer lines has no ``ood``)."""
        return tuple(s for s in SPLITS if cls.tasks.get(s))

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split`` drawn with replacement (seeded), or an error naming the empty split."""
        if cls.verify is None:
            raise EnvError("jsonl_tools needs a task file: set env.data (and env.tools, env.verifier) in the config")
        pool = cls.tasks.get(split, [])
        if not pool:
            raise EnvError(f"jsonl_tools: the task file has no {split!r} tasks; label some with \"split\": "
                           f"\"{split}\"" + (" (ood tasks are only ever labelled)" if split == "ood" else ""))
        rng = random.Random(f"ctxrl-jsonl:{seed}:{split}")
        return [rng.choice(pool) for _ in range(n)]

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        return list(task.data.get("solution") or [f"<answer>{task.answer}</answer>"])

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return bool(self.verify(given, task.answer)), {}
