"""Live progress of a run: bars on a terminal (``rich``), plain lines elsewhere, or nothing.

The trainer reports what it is doing through a ``Progress``; it never prints. ``ConsoleProgress``
draws bars on stderr (the warm start's steps, the RL steps with their last figures) and prints
one-line messages above them; ``LineProgress`` writes plain lines instead, for stderr that is not a terminal
(a pipe, a log file under nohup or CI, a notebook), where bars would be redrawn as a flood of escape codes or
not at all: a line per RL step, a few per stage, each with its clock and an ETA where the total is known.
``console_progress`` picks one; ``Progress`` itself does nothing, for library use and tests.

Honest bars: a stage that ends stops its clock and says ``done`` (stages run one at a time, so a stage of
unknown length ends when the next one starts), and the RL line fits the terminal: its figures come most
important first and those that do not fit are left out, rather than the line being wrapped or cut.
"""

from __future__ import annotations

import sys
import time
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

    def errored(self, where: str, errored: int, total: int, first_error: str) -> None:
        """``errored`` of ``total`` episodes at ``where`` (``step 12``, an evaluation) errored, the first with
        ``first_error``: said as it happens, not only counted in the metrics."""
        first = (str(first_error).strip().splitlines() or ["(no reason recorded)"])[0]
        first = first if len(first) <= 200 else first[:199] + "…"
        self.message(f"{where}: {errored} of {total} episodes errored: {first}")

    def close(self) -> None:
        """Stop drawing."""


def console_progress(*, quiet: bool = False, stream=None) -> Progress:
    """Bars when ``stream`` (default stderr, where progress goes) is a terminal, plain lines when it is not (a
    pipe, a file, a notebook's stream); nothing when ``quiet``."""
    stream = stream or sys.stderr
    if quiet:
        return Progress()
    return ConsoleProgress() if stream.isatty() else LineProgress(stream)


class LineProgress(Progress):
    """Plain lines on ``stream``: one per RL step (its figures, the time so far and an ETA), and for each stage
    (the warm start, the tiny model's build, an evaluation) its count and ETA when a tenth more is done and
    ``every`` seconds have passed since its last line, and its end with its time (a stage of unknown length: its
    start and its end). Nothing is redrawn, so a log
    file reads as it was written; ``clock``: a stand-in for ``time.monotonic`` (tests)."""

    def __init__(self, stream=None, *, every: float = 10.0, clock=time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.every = every
        self.clock = clock
        self._stage: list | None = None  # [name, started, tenths said, time of its last line]
        self._rl: tuple[int, int, float] | None = None  # (total, first step, started)
        self._done = 0

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        from rich.text import Text

        self._line(Text.from_markup(text).plain)  # (the messages carry the terminal's [bold] markup)

    def sft(self, step: int, total: int, loss: float) -> None:
        self._count("warm start (SFT)", step, total, f", loss {loss:.3f}")

    def stage(self, name: str, done: int, total: int) -> None:
        self._count(name, done, total, "")

    def _count(self, name: str, done: int, total: int, figures: str) -> None:
        now = self.clock()
        if self._stage is None or self._stage[0] != name:
            self._end_stage()
            self._stage = [name, now, 0, now]
            if not total:  # (a count says it started: its first line, after ``every`` seconds, has its ETA)
                self._line(f"{name}: started")
        started, said, last = self._stage[1:]
        if not total:
            return
        elapsed = now - started
        if done >= total:
            self._line(f"{name}: {done}/{total} done in {clock(elapsed)}{figures}")
            self._stage = None
        elif done * 10 // total > said and now - last >= self.every:
            self._stage[2:] = [done * 10 // total, now]
            self._line(f"{name}: {done}/{total} after {clock(elapsed)}, eta {clock(elapsed / done * (total - done))}"
                       f"{figures}")

    def _end_stage(self) -> None:
        """A stage of unknown length ends when the next starts (work moves on one stage at a time)."""
        if self._stage is not None:
            self._line(f"{self._stage[0]}: done in {clock(self.clock() - self._stage[1])}")
            self._stage = None

    def rl_start(self, label: str, total: int, completed: int) -> None:
        self._end_stage()
        self._rl, self._done = (total, completed, self.clock()), completed
        self._line(f"{label}: {total} steps" + (f", resuming after step {completed}" if completed else ""))

    def rl_step(self, fields: list[str]) -> None:
        if self._rl is None:
            return
        total, first, started = self._rl
        self._done += 1
        elapsed = self.clock() - started
        eta = elapsed / (self._done - first) * (total - self._done)
        self._line(f"step {self._done}/{total}: {' '.join(fields)} | {clock(elapsed)}, eta {clock(eta)}")

    def close(self) -> None:
        self._stage = None  # (what did not end, a crash or a signal, is not called done)


def clock(seconds: float) -> str:
    """``1:02:03``, ``4:05`` or ``12s``: a duration as a line reads it."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}" if minutes else f"{secs}s"


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
