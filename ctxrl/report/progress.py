"""Live progress of a run on the terminal (``rich``), or nothing.

The trainer reports what it is doing through a ``Progress``; it never prints. ``ConsoleProgress``
draws bars on stderr (the warm start's steps, the RL steps with their last figures) and prints
one-line messages above them; ``Progress`` itself does nothing, for library use and tests.
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

    def rl_step(self, info: str) -> None:
        """One RL step finished; ``info`` is its summary."""

    def stage(self, name: str, done: int, total: int) -> None:
        """A stage of work (the tiny model's build, an evaluation) is at ``done`` of ``total`` (0: unknown)."""

    def close(self) -> None:
        """Stop drawing."""


class ConsoleProgress(Progress):
    """Bars and messages on stderr (nothing when ``quiet``)."""

    def __init__(self, *, quiet: bool = False) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bars

        self.console = Console(stderr=True, quiet=quiet)
        self.bars = Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                         console=self.console, transient=False)
        self.bars.start()
        self._sft = self._rl = None
        self._stages: dict[str, object] = {}

    def message(self, text: str) -> None:
        self.bars.console.print(text)

    def sft(self, step: int, total: int, loss: float) -> None:
        if self._sft is None:
            self._sft = self.bars.add_task("warm start (SFT)", total=total, info="")
        self.bars.update(self._sft, completed=step, total=total, info=f"loss {loss:.3f}")

    def rl_start(self, label: str, total: int, completed: int) -> None:
        self._rl = self.bars.add_task(label, total=total, completed=completed, info="")

    def rl_step(self, info: str) -> None:
        if self._rl is not None:
            self.bars.update(self._rl, advance=1, info=info)

    def stage(self, name: str, done: int, total: int) -> None:
        if name not in self._stages:
            self._stages[name] = self.bars.add_task(name, total=total or None, info="")
        self.bars.update(self._stages[name], completed=done, total=total or None)

    def close(self) -> None:
        self.bars.stop()
