"""Environments whose one tool spends a guess from a per-attempt budget (``task.context["guesses"]``).

``codebreak`` and ``hidden_word`` share the bookkeeping: each valid guess is counted; the attempt is won by the
guess that finds the hidden thing and lost when the guesses run out (``tool_outcome``); a guess after either is
refused with an error observation that uses no guess. Each environment checks its own argument first and says
what its guess revealed.
"""

from __future__ import annotations

from typing import ClassVar

from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.types import Message, Task


class GuessBudgetEnv(ToolAnswerEnv):
    """A ``ToolAnswerEnv`` whose tool calls are guesses from a budget of ``task.context["guesses"]`` per attempt."""

    hidden: ClassVar[str] = "answer"
    """What is hidden, as the refusal after a win names it (``the code is already found``)."""

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        messages = super().reset(task, seed=seed)
        self._used = 0
        self._solved = False
        return messages

    def spend_guess(self, action: str, *, solved: bool) -> int:
        """Count one valid guess (``action`` is what it did, ``solved`` whether it found the hidden thing); refused
        (``ValueError``, an error observation) once the attempt is won or out of guesses. Returns the guesses left."""
        if self._solved:
            raise ValueError(f"the {self.hidden} is already found")
        if self._used >= self._task.context["guesses"]:
            raise ValueError("no guesses left")
        self._used += 1
        self._solved = solved  # (a later call of the same turn is refused: a win stays a win)
        self.note_action(action, failed=not solved)
        return self._task.context["guesses"] - self._used

    def tool_outcome(self) -> bool | None:
        if self._solved:
            return True
        return False if self._task is not None and self._used >= self._task.context["guesses"] else None
