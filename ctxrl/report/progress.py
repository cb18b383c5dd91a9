"""Live progress of a run on the terminal (``rich``), or nothing.

The trainer reports what it is doing through a ``Progress``; it never prints. ``ConsoleProgress``
draws bars on stderr (the warm start's steps, the RL steps with their last figures) and prints
one-line messages above them; ``Progress`` itself does nothing, for library use and tests.

Honest bars: a stage that ends stops its clock and says ``done`` (stages run one at a time, so a stage of
unknown length ends when the next one starts), and the RL line fits the terminal: its figures come most
important first and those that do not fit are left out, rather than the line being wrapped or cut.
"""

from __future__ import annotations

from typing import Any


class Progress:
    """Silent progress: every method does nothing (the base the console version overrides)."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def message(self, text: str) -> None:
        """One line of news (the run directory, a resume, the figures after the warm start)."""

    def sft(self, step: int, total: int, loss: float) -> None:
        """Warm-start step ``step`` of ``total`` finished with ``loss``."""

    def rl_start(self, label: str, total: int, completed: int) -> None:
        """RL starts (or resumes at ``completed``) towards ``total`` steps."""

    def rl_step(self, fields: list[str]) -> None:
        """One RL step finished; ``fields`` are its figures, most important first."""

    def stage(self, name: str, done: int, total: int) -> None:
        """A stage of work (the tiny model's build, an evaluation) is at ``done`` of ``total`` (0: unknown)."""

    def close(self) -> None:
        """Stop drawing."""


class ConsoleProgress(Progress):
    """Bars and messages on stderr (nothing when ``quiet``); ``console``: draw there instead (tests)."""

    def __init__(self, *, quiet: bool = False, console=None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bars

        self.console = console or Console(stderr=True, quiet=quiet)
        wide = self.console.width >= 100  # narrower: a shorter bar and no "eta" label, room for the figures
        self.bar_width = 40 if self.console.width >= 120 else 20 if wide else 8
        eta = [TextColumn("eta")] if wide else []
        self.bars = Bars(TextColumn("{task.description}"), BarColumn(bar_width=self.bar_width), MofNCompleteColumn(),
                         TimeElapsedColumn(), *eta, TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                         console=self.console, transient=False)
        self._fixed = len(self.bars.columns) - 1 + self.bar_width + 7 + 7 + (3 if wide else 0)
        self._sft = self._rl = None
        self._stages: dict[str, object] = {}

    def message(self, text: str) -> None:
        self.bars.console.print(text)

    def sft(self, step: int, total: int, loss: float) -> None:
        if self._sft is None:
            self._end_stages()
            self._sft = self._add("warm start (SFT)", total=total)
        self.bars.update(self._sft, completed=step, total=total, info=f"loss {loss:.3f}")

    def rl_start(self, label: str, total: int, completed: int) -> None:
        self._end_stages()
        self._rl = self._add(label, total=total, completed=completed)

    def rl_step(self, fields: list[str]) -> None:
        if self._rl is not None:
            task = self.bars.tasks[self._rl]
            self.bars.update(self._rl, advance=1, info=fit_fields(fields, self._room(task.total)))

    def stage(self, name: str, done: int, total: int) -> None:
        if name not in self._stages:
            self._end_stages()
            self._stages[name] = self._add(name, total=total or None)
        self.bars.update(self._stages[name], completed=done, total=total or None)
        if total and done >= total:
            self._end(self._stages.pop(name))

    def _add(self, description: str, **fields):
        """A new line; the bars start drawing with the first (a refusal before any work prints alone)."""
        if not self.bars.live.is_started:
            self.bars.start()
        return self.bars.add_task(description, info="", **fields)

    def _end_stages(self) -> None:
        """The stages still open have ended: work moves on one stage at a time."""
        for task_id in self._stages.values():
            self._end(task_id)
        self._stages.clear()

    def _end(self, task_id) -> None:
        task = self.bars.tasks[task_id]
        total = task.total or max(task.completed, 1)
        self.bars.update(task_id, total=total, completed=total, info="done")
        self.bars.stop_task(task_id)

    def _room(self, total: float | None) -> int:
        """Columns left for the RL line's figures. The bars form one table, so the widest description and count
        of any line (the last evaluation's to come included) set the other columns' widths; ``_fixed`` holds the
        bar, two clocks of 7, the "eta" label and a space between columns."""
        descriptions = [task.description for task in self.bars.tasks] + [f"eval (step {int(total or 0)}, heldout)"]
        counts = [2 * len(str(int(task.total or 0))) + 1 for task in self.bars.tasks]
        return self.console.width - max(map(len, descriptions)) - max(counts) - self._fixed

    def close(self) -> None:
        for task in self.bars.tasks:  # clocks stop; what did not end (a crash, a signal) is not called done
            self.bars.stop_task(task.id)
        if self.bars.live.is_started:  # (stopping bars that never drew still prints a line)
            self.bars.stop()


def fit_fields(fields: list[str], width: int) -> str:
    """The first of ``fields`` that fit in ``width`` columns, joined by spaces (none: an empty string)."""
    shown = ""
    for field in fields:
        candidate = f"{shown} {field}" if shown else field
        if len(candidate) > width:
            break
        shown = candidate
    return shown
