"""A trial's outcome as plain data: the attempts it played, their rewards, successes and actions.

Deliberately small and independent of ``ctxrl.types.Episode``: the statistics and the credit
need only these numbers, and the rollout can build them from its episodes (one ``Attempt`` per
attempt episode) without this module knowing about tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Attempt:
    """One attempt of a trial, as the statistics see it."""

    reward: float
    """The attempt's own reward (``Episode.reward``), before any cross-attempt credit."""
    success: bool
    """Whether the attempt solved the task (``Episode.success``)."""
    actions: list[str] = field(default_factory=list)
    """The attempt's actions as canonical strings (a tool call with its arguments, a move, an answer)."""
    failed_actions: list[str] | None = None
    """Actions the environment judged failed (a wrong answer, an invalid move). ``None``: all of
    ``actions`` if the attempt failed, none if it succeeded (right when an action is a whole answer)."""

    def failed(self) -> set[str]:
        """The set of this attempt's failed actions (see ``failed_actions``)."""
        if self.failed_actions is not None:
            return set(self.failed_actions)
        return set() if self.success else set(self.actions)


@dataclass
class Trial:
    """Up to ``num_attempts`` attempts at one task; it may stop early only on a success."""

    task_id: str
    num_attempts: int
    """The attempt budget K the trial was played with."""
    attempts: list[Attempt]

    @property
    def rewards(self) -> list[float]:
        """Per-attempt rewards, the input of ``ctxrl.algo.credit``."""
        return [a.reward for a in self.attempts]

    @property
    def solved_at(self) -> int | None:
        """0-based index of the first successful attempt, ``None`` if no attempt succeeded."""
        return next((k for k, a in enumerate(self.attempts) if a.success), None)

    def check(self) -> None:
        """Raise ``ValueError`` naming the problem if this is not a well-formed trial."""
        n = len(self.attempts)
        if self.num_attempts < 1:
            raise ValueError(f"trial of task {self.task_id!r}: num_attempts must be >= 1, got {self.num_attempts}")
        if n == 0:
            raise ValueError(f"trial of task {self.task_id!r} has no attempts; drop trials whose first attempt errored")
        if n > self.num_attempts:
            raise ValueError(f"trial of task {self.task_id!r} has {n} attempts, more than its budget "
                             f"num_attempts={self.num_attempts}; set num_attempts to the K it was played with")
        if n < self.num_attempts and not self.attempts[-1].success:
            raise ValueError(f"trial of task {self.task_id!r} has {n} of {self.num_attempts} attempts and its last one "
                             "failed: a trial may stop early only on a success; drop trials cut short by an error")
