"""``jsonl_tools``: train on your own tasks without writing an environment class.

A JSONL file holds one task per line::

    {"prompt": "What is 17 * 23?", "answer": "391"}
    {"prompt": "...", "answer": "...", "id": "q7", "split": "ood", "context": {"level": 3}, "tools": ["add"],
     "solution": ["<tool_call>...</tool_call>", "<answer>...</answer>"]}

``prompt`` (a non-empty string) and ``answer`` (a non-empty string, or a number) are required.
``tools`` (a list of tool names, built-in or MCP) is optional: the tools this task offers, of those the run
configures (``env.jsonl_tools.tools``, ``env.mcp_servers``); without it a task offers them all. ``split`` (``train``,
``heldout`` or ``ood``) is optional: unlabelled tasks go to ``train`` or
``heldout`` by a stable hash of the prompt (20% held out); ``ood`` exists only for labelled tasks:
a file without it trains and evaluates on the splits it has (``splits()``), and the missing one is
reported once as skipped. ``solution`` (assistant
texts) is what ``solve()`` plays; without it ``solve()`` answers directly. The episode has the
``ToolAnswerEnv`` shape: tool turns get observations, the first turn without a call is the scored
answer.

Configuration: ``[env]`` ``name = "jsonl_tools"``, ``data`` (the file); its own table ``[env.jsonl_tools]``
(``JsonlToolsSettings``): ``tools`` (comma-separated built-in tools: ``calculator``, ``python``) and ``verifier``
(``exact``: equal after SQuAD normalisation; ``numeric``: equal as numbers, via sympy; ``contains``: the normalised
gold appears in the normalised answer). ``JsonlToolsEnv.configure(data=..., tools=..., verifier=...)`` returns the
environment class bound to them.

A file that cannot be trained on is refused before anything loads (``configure``, so ``ctxrl config`` too),
with one line naming the file, the line and the fix: bytes that are not UTF-8, a line that is not a JSON
object, a field of the wrong type (``context`` must be an object, ``solution`` and ``tools`` lists of strings, ``id``
a string or number), an empty or null ``answer`` (``exact`` and ``contains`` would take any reply for it, and
``null`` is no answer), one that ``exact``/``contains`` normalise away (``"the"``), and a prompt longer than
``rollout.max_total_tokens`` can hold (``check_tasks``: by characters when the run is configured, by the
model's tokenizer once a rollout worker has it), a lone surrogate (``"\\ud800"``: valid JSON, but no text:
``ctxrl.chat.surrogates``), a number of more digits than Python reads (write it as a string), and an ``id`` that
an earlier line has already. A task naming a tool the run does not offer is refused when the
first environment is built (an MCP server's tools are known only once it runs): a rollout worker builds one before
any episode.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ctxrl.chat.surrogates import find_surrogate
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextSpace, split_of, task_id
from ctxrl.tools.base import Tool
from ctxrl.tools.builtin import builtin_tool
from ctxrl.types import SPLITS, Message, Task


def _tool(name: str) -> Tool:
    try:
        return builtin_tool(name)
    except KeyError as exc:
        raise EnvError(f"jsonl_tools: {exc.args[0]}") from None


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


CHARS_PER_TOKEN = 16
"""Without the model's tokenizer, a prompt of more than ``CHARS_PER_TOKEN * rollout.max_total_tokens`` characters
is refused: ordinary text takes about 4 characters a token, and no tokenizer packs 16 into each on average
(a file of such prompts made a warm start try to allocate 90 GB)."""


def load_tasks(path: str | Path, heldout_fraction: float = 0.2, *, verifier: str = "exact") -> dict[str, list[Task]]:
    """Tasks of a JSONL file by split; every problem names the file and line (see the module docstring)."""
    by_split: dict[str, list[Task]] = {s: [] for s in SPLITS}
    for _, task in read_tasks(path, heldout_fraction, verifier=verifier):
        by_split[task.split].append(task)
    return by_split


def read_tasks(path: str | Path, heldout_fraction: float = 0.2, *, verifier: str = "exact") -> list[tuple[str, Task]]:
    """Each task of a JSONL file with where it is (``FILE:LINE``), in file order."""
    if not str(path):
        raise EnvError("jsonl_tools needs a task file: set env.data to a JSONL file (check-env: --data FILE)")
    path = Path(path)
    if not path.is_file():
        raise EnvError(f"jsonl_tools: task file {str(path)!r} does not exist or is not a file "
                       "(set env.data to a JSONL file)")
    tasks, ids = [], {}
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise EnvError(f"{where}: not UTF-8 (byte {raw[exc.start:exc.start + 1]!r} at column {exc.start + 1}); "
                               "save the task file as UTF-8") from None
            if not line.strip():
                continue
            row = _row(line, where)
            task = _task(row, where, heldout_fraction, verifier)
            if "id" in row and row["id"] not in (None, ""):
                if task.id in ids:
                    raise EnvError(f"{where}: task id {task.id!r} is taken already, by line {ids[task.id]}; give each "
                                   "task an id of its own")
                ids[task.id] = line_no
            tasks.append((where, task))
    if not tasks:
        raise EnvError(f"jsonl_tools: {path} holds no tasks")
    return tasks


def _row(line: str, where: str) -> Any:
    """One line's JSON, or an ``EnvError`` naming what keeps it from being a task's."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EnvError(f"{where}: not JSON ({exc.msg}); one task object per line") from None
    except RecursionError:
        raise EnvError(f"{where}: JSON nested too deep; one flat task object per line") from None
    except ValueError:  # (an integer of more digits than Python converts)
        raise EnvError(f"{where}: a number of more than {sys.get_int_max_str_digits()} digits, more than Python "
                       "reads; write it as a string (\"answer\": \"123...\")") from None
    found = find_surrogate(row)
    if found is not None:
        field = f'a key of "{found[9:]}"' if found.startswith("a key of ") else f'"{found}"'
        raise EnvError(f"{where}: {field} holds a lone surrogate (a \\ud800-\\udfff escape on its own), which is "
                       "not text; write the character itself (a pair of escapes), or drop it")
    return row


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _task(row: Any, where: str, heldout_fraction: float, verifier: str) -> Task:
    """One line's task, or an ``EnvError`` naming the field, what it is and what it must be."""
    from ctxrl.tools.search import normalize_answer

    if not isinstance(row, dict):
        raise EnvError(f'{where}: a task is a JSON object such as {{"prompt": "...", "answer": "..."}}, '
                       f"not {_kind(row)}")
    if "prompt" not in row:
        raise EnvError(f'{where}: the task has no "prompt"; give the task\'s text as a string')
    prompt = row["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise EnvError(f'{where}: "prompt" must be a non-empty string, got '
                       f"{'an empty one' if isinstance(prompt, str) else _kind(prompt)}")
    if "answer" not in row:
        raise EnvError(f'{where}: the task has no "answer"; give the expected answer as a string or number')
    answer = row["answer"]
    if answer is None:
        raise EnvError(f'{where}: "answer" is null, which no reply can match (it would be the text "None"); '
                       "give the expected answer, or drop the task")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise EnvError(f'{where}: "answer" must be a string or a number, got {_kind(answer)}')
    if isinstance(answer, float) and not math.isfinite(answer):
        raise EnvError(f'{where}: "answer" is {answer}, not a number a reply can give; write it as a string')
    answer = str(answer)
    if not answer.strip():
        raise EnvError(f'{where}: "answer" is empty: the exact and contains verifiers would take any reply for it; '
                       "give the expected answer, or drop the task")
    if verifier in ("exact", "contains") and not normalize_answer(answer):
        raise EnvError(f'{where}: "answer" {answer!r} is empty once the {verifier} verifier normalises it (it drops '
                       "punctuation and a/an/the), so it would take any reply; give a real answer or use "
                       "env.jsonl_tools.verifier = \"numeric\"")
    split = row.get("split") or split_of(prompt, heldout_fraction)
    if split not in SPLITS:
        raise EnvError(f"{where}: split {split!r} is not one of {', '.join(SPLITS)}")
    solution = row.get("solution")
    if solution is not None and (not isinstance(solution, list) or not all(isinstance(t, str) for t in solution)):
        raise EnvError(f'{where}: "solution" must be a list of assistant texts (strings), got {_kind(solution)}'
                       + ("" if not isinstance(solution, list) else " holding other values"))
    context = row.get("context")
    if context is not None and not isinstance(context, dict):
        raise EnvError(f'{where}: "context" must be an object of labels such as {{"level": 3}}, got {_kind(context)}')
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, str) and t for t in tools)):
        raise EnvError(f'{where}: "tools" must be a list of tool names (non-empty strings) such as ["calculator"], '
                       f"got {_kind(tools)}" + ("" if not isinstance(tools, list) else " holding other values"))
    task_id_ = row.get("id")
    if task_id_ is not None and (isinstance(task_id_, bool) or not isinstance(task_id_, (str, int))):
        raise EnvError(f'{where}: "id" must be a string or an integer, got {_kind(task_id_)}')
    data = {"solution": solution} if solution else {}
    if tools is not None:
        data["tools"] = tools
    return Task(id=str(task_id_ if task_id_ not in (None, "") else task_id("jsonl", prompt)), prompt=prompt,
                answer=answer, context=dict(context or {}), split=split, data=data)


def check_prompts(tasks: list[tuple[str, Task]], max_total_tokens: int,
                  count_tokens: Callable[[str], int] | None = None) -> None:
    """Refuse the first task whose prompt cannot fit ``max_total_tokens``: measured with ``count_tokens`` (the
    model's tokenizer), else bounded by ``CHARS_PER_TOKEN`` characters a token."""
    for where, task in tasks:
        size = len(task.prompt)
        if count_tokens is None:
            if size > CHARS_PER_TOKEN * max_total_tokens:
                raise EnvError(f"{where}: the prompt is {size} characters, more than rollout.max_total_tokens = "
                               f"{max_total_tokens} tokens can hold (no tokenizer packs {CHARS_PER_TOKEN} characters "
                               "into a token); shorten the prompt, drop the task, or raise rollout.max_total_tokens")
        elif len(task.prompt.encode()) + 8 >= max_total_tokens:  # (a tokenizer gives at most a token per byte)
            tokens = count_tokens(task.prompt)
            if tokens >= max_total_tokens:
                raise EnvError(f"{where}: the prompt takes {tokens} tokens of the model's tokenizer, and "
                               f"rollout.max_total_tokens = {max_total_tokens} must hold the whole episode; shorten "
                               "the prompt, drop the task, or raise rollout.max_total_tokens")


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


@dataclass(frozen=True)
class JsonlToolsSettings:
    """``[env.jsonl_tools]``: what the tasks of the file are played with."""

    tools: str = ""
    """Comma-separated built-in tools (``calculator``, ``python``)."""
    verifier: str = "exact"
    """Answer check: ``exact``, ``numeric`` or ``contains``."""


@register("jsonl_tools")
class JsonlToolsEnv(ToolAnswerEnv):
    """Tasks from a JSONL file, built-in tools by name, a named verifier (see the module docstring)."""

    name: ClassVar[str] = "jsonl_tools"
    system_prompt: ClassVar[str] = "Use the tools if they help. Reply with <answer>ANSWER</answer>."
    context_space: ClassVar[ContextSpace] = ContextSpace([])
    tasks: ClassVar[dict[str, list[Task]]] = {}
    sources: ClassVar[tuple[tuple[str, Task], ...]] = ()
    """Each task with where it is in the file (``FILE:LINE``), for ``check_tasks``."""
    tool_names: ClassVar[tuple[str, ...]] = ()
    task_tools: ClassVar[dict[str, str]] = {}
    """Each tool name the tasks name, with where it is first named (``FILE:LINE``)."""
    verify: ClassVar[Callable[[str, str], bool] | None] = None
    Settings: ClassVar[type] = JsonlToolsSettings

    @classmethod
    def configure(cls, *, data: str, tools: str = "", verifier: str = "exact", **_: Any) -> type:
        """A subclass bound to a task file, tools and verifier (checked now, not mid-rollout)."""
        names = tuple(t.strip() for t in tools.split(",") if t.strip())
        for n in names:
            _tool(n)
        verify = _verifier(verifier)
        sources = read_tasks(data, verifier=verifier)
        tasks: dict[str, list[Task]] = {s: [] for s in SPLITS}
        task_tools: dict[str, str] = {}
        for where, task in sources:
            tasks[task.split].append(task)
            for name in task.data.get("tools", ()):
                task_tools.setdefault(name, where)
        return type(cls.__name__, (cls,), {"tasks": tasks, "sources": tuple(sources), "tool_names": names,
                                          "task_tools": task_tools, "verify": staticmethod(verify),
                                          "context_space": _observed_space(tasks)})

    @classmethod
    def check_tasks(cls, max_total_tokens: int, count_tokens: Callable[[str], int] | None = None) -> None:
        """Refuse a task file with a prompt longer than ``rollout.max_total_tokens`` can hold (``check_prompts``)."""
        check_prompts(list(cls.sources), max_total_tokens, count_tokens)

    def __init__(self) -> None:
        if self.verify is None:
            raise EnvError("jsonl_tools needs a task file: set env.data (and [env.jsonl_tools] tools, verifier) in "
                           "the config")
        super().__init__()
        self.offered = self.tools
        """Every tool the run configures; an episode offers the ones its task names (``reset``)."""
        names = {t.name for t in self.offered}
        for name, where in self.task_tools.items():
            if name not in names:
                raise EnvError(f"{where}: the task names tool {name!r}, which this run does not offer; it offers "
                               f"{', '.join(sorted(names)) or 'no tools'} (env.jsonl_tools.tools: built-in tools; "
                               "env.mcp_servers: MCP tools)")

    def make_tools(self) -> list[Tool]:
        return [_tool(n) for n in self.tool_names]

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        """Start an episode offering the tools ``task`` names (all the run's tools when it names none)."""
        named = task.data.get("tools")
        self.tools = self.offered if named is None else [t for t in self.offered if t.name in set(named)]
        return super().reset(task, seed=seed)

    @classmethod
    def splits(cls) -> tuple[str, ...]:
        """The splits the task file has tasks for (a file of bare prompt/answer lines has no ``ood``)."""
        return tuple(s for s in SPLITS if cls.tasks.get(s))

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split`` drawn with replacement (seeded), or an error naming the empty split."""
        if cls.verify is None:
            raise EnvError("jsonl_tools needs a task file: set env.data (and [env.jsonl_tools] tools, verifier) in "
                           "the config")
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
