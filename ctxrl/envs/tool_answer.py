"""``ToolAnswerEnv``: the shape most tool-use tasks share, written once.

An episode opens with the system prompt and the task's prompt; every assistant turn with tool
calls gets the tools' observations (reward 0); the first turn without a call ends the episode,
and its ``<answer>...</answer>`` is scored by ``check_answer``. A subclass gives the class
attributes (``name``, ``system_prompt``, ``context_space``, ``heldout_fraction``), a
``generate(context, rng) -> (prompt, answer, data)`` static method, ``make_tools()``,
``solve(task)`` and ``check_answer(given, task) -> (correct, extra_info)`` (or, for partial credit,
``score_answer(given, task) -> (reward in [0, 1], extra_info)``: correct means 1); ``required_data``
names the ``task.data`` keys ``reset`` insists on; ``tool_outcome()`` lets a tool turn end the
episode (a solved puzzle, a revealed mine).

An environment whose class sets ``names_actions = True`` has its tools call ``note_action(action,
failed=...)`` for what they did, in its own terms (``"reveal 2,3"``, ``"pull 1"``); each step's
``info`` then carries ``actions`` and ``failed_actions`` (lists of strings), which the meta
statistics use for exploration (how often a later attempt repeats what failed before). Otherwise
they judge whole tool calls and answers, failed when the attempt failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ctxrl.envs.base import EnvError
from ctxrl.tasks.space import ContextSpace, parse_ranges, sample_tasks
from ctxrl.tools.base import Tool, execute_tool_calls
from ctxrl.types import Message, StepResult, Task

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_answer(text: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` in ``text``, or None."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


@dataclass(frozen=True)
class Settings:
    """What every tool-answer environment reads from its table ``[env.NAME]``."""

    context_ranges: str = ""
    """Narrower train and held-out ranges for some of the environment's context params, ``NAME=LOW-HIGH`` comma-
    separated (``pages=3-4``: only trails of 3 or 4 pages); each within the param's own train range. OOD tasks keep
    their ranges. Empty: the environment's own ranges."""

    def __post_init__(self) -> None:
        parse_ranges(self.context_ranges)  # (malformed: an error as the config loads; a wrong name: check_options)


class ToolAnswerEnv:
    name: ClassVar[str]
    system_prompt: ClassVar[str]
    context_space: ClassVar[ContextSpace]
    heldout_fraction: ClassVar[float] = 0.2
    required_data: ClassVar[tuple[str, ...]] = ()
    names_actions: ClassVar[bool] = False
    """True when the tools ``note_action`` every action (see the module docstring)."""
    Settings: ClassVar[type] = Settings
    options: ClassVar[Settings] = Settings()

    def __init__(self) -> None:
        self.tools: list[Tool] = self.make_tools()
        self._task: Task | None = None
        self._terminated = False
        self._noted: tuple[list[str], list[str]] = ([], [])

    def note_action(self, action: str, *, failed: bool = False) -> None:
        """Record an action of the current step (and whether it failed) for the step's ``info``."""
        self._noted[0].append(action)
        if failed:
            self._noted[1].append(action)

    def noted_actions(self) -> dict[str, list[str]]:
        """The actions noted since the last call, as ``info`` entries (empty if none), and forget them."""
        actions, failed = self._noted
        self._noted = ([], [])
        return {"actions": actions, "failed_actions": failed} if actions else {}

    # -- what a subclass provides ------------------------------------------------------------------
    def make_tools(self) -> list[Tool]:
        raise NotImplementedError(f"{type(self).__name__} must define make_tools()")

    @staticmethod
    def generate(context: dict[str, Any], rng) -> tuple[str, str, dict[str, Any]]:
        raise NotImplementedError("a ToolAnswerEnv must define generate(context, rng)")

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} must define check_answer(given, task)")

    def score_answer(self, given: str, task: Task) -> tuple[float, dict[str, Any]]:
        """The answer's reward in [0, 1] (1: correct) and extra ``info``; by default ``check_answer``'s verdict."""
        correct, extra = self.check_answer(given, task)
        return (1.0 if correct else 0.0), extra

    def tool_outcome(self) -> bool | None:
        """After a tool turn: True (won) or False (lost) ends the episode there; None goes on.

        For tasks a tool can finish (a puzzle solved by a move, a mine revealed)."""
        return None

    # -- the protocol ----------------------------------------------------------------------------
    @classmethod
    def task_space(cls) -> ContextSpace:
        """The context space tasks are drawn from: ``context_space``, narrowed by ``[env.NAME].context_ranges``."""
        ranges = parse_ranges(getattr(cls.options, "context_ranges", ""))  # (a subclass may have Settings of its own)
        return cls.context_space.narrowed(ranges) if ranges else cls.context_space

    @classmethod
    def check_options(cls) -> None:
        """A ``ValueError`` when ``[env.NAME].context_ranges`` names a param this environment lacks, a range outside
        it, or an environment that draws its tasks some other way: found when the configured class is made, before
        any model loads."""
        own_draw = cls.sample_tasks.__func__ is not ToolAnswerEnv.sample_tasks.__func__
        if getattr(cls.options, "context_ranges", "") and own_draw:
            raise ValueError(f"environment {cls.name!r} draws its tasks from its own source, so context_ranges has "
                             "nothing to narrow; remove it")
        cls.task_space()

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split``, drawn from ``task_space()``."""
        return sample_tasks(cls.generate, cls.task_space(), split, n, seed, heldout_fraction=cls.heldout_fraction,
                            id_prefix=cls.name)

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        """Start an episode (deterministic: ``seed`` is unused by this shape)."""
        missing = [k for k in self.required_data if k not in task.data]
        if missing:
            raise EnvError(f"task {task.id} lacks data{missing}; draw {self.name} tasks with sample_tasks")
        self._task, self._terminated = task, False
        self._noted = ([], [])
        return [Message(role="system", content=self.system_prompt), Message(role="user", content=task.prompt)]

    async def step(self, message: Message) -> StepResult:
        """Tool calls -> observations (reward 0); a turn without a call ends the episode, scored.

        A message with both tool calls and an ``<answer>`` counts as a tool turn.
        """
        if self._task is None:
            raise EnvError("step() called before reset(task); start an episode with reset first")
        if self._terminated:
            raise EnvError("step() called after the episode terminated; call reset(task) to start a new episode")
        if message.tool_calls or message.tool_call_errors:
            observations, counts = await execute_tool_calls(self.tools, message)
            counts = {**counts, **self.noted_actions()}
            outcome = self.tool_outcome()
            if outcome is not None:
                self._terminated = True
                return StepResult(messages=observations, reward=1.0 if outcome else 0.0, terminated=True,
                                  info={**counts, "answered": True, "correct": outcome})
            return StepResult(messages=observations, reward=0.0, terminated=False, info=counts)
        self._terminated = True
        given = parse_answer(message.content)
        score, extra = self.score_answer(given or "", self._task)
        score = float(score) if given is not None else 0.0
        return StepResult(messages=[], reward=score, terminated=True,
                          info={"answered": given is not None, "correct": score >= 1.0, **extra})

    def close(self) -> None:
        self._task = None
        self._terminated = False
