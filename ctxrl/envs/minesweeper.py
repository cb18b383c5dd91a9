"""The ``minesweeper`` environment: reveal every safe cell of a small board without hitting a mine.

The board is text: ``?`` hidden, a digit the number of mines around a revealed cell (``0`` for
none). The ``reveal`` tool takes one or more cells as ``"row,col"`` pairs separated by ``;``
(``"0,3; 1,3"``), reveals them in order (a ``0`` also opens its neighbours, as in the game) and
returns the board; revealing a mine ends the episode with reward 0. Revealing every safe cell
ends it with reward 1. Each revealed cell is an action (``reveal r,c``); the mine is the failed one
(``info["failed_actions"]``). LaMer and RAGEN use it for multi-turn reasoning under partial observation.

Every level can be solved by logic alone from its first revealed cell (no guessing): the
generator keeps only boards that a constraint solver (the single-cell rules plus the subset rule)
clears completely, and ``solve()`` replays that solver's deductions, one ``reveal`` call per
round of deductions. Context: ``size`` (rows and columns, train 4-5, ood 6-7) and ``density``
(fraction of mines, 0.10-0.20 everywhere).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.types import Message, Task

Cell = tuple[int, int]


def neighbours(cell: Cell, size: int) -> list[Cell]:
    r, c = cell
    return [(r + dr, c + dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)
            if (dr or dc) and 0 <= r + dr < size and 0 <= c + dc < size]


def counts(mines: set[Cell], size: int) -> dict[Cell, int]:
    return {(r, c): sum(n in mines for n in neighbours((r, c), size)) for r in range(size) for c in range(size)}


def flood(cell: Cell, mines: set[Cell], size: int, revealed: set[Cell]) -> set[Cell]:
    """Cells opened by revealing ``cell`` (a 0 opens its neighbours, recursively)."""
    number = counts(mines, size)
    opened, stack = set(), [cell]
    while stack:
        here = stack.pop()
        if here in opened or here in revealed or here in mines:
            continue
        opened.add(here)
        if number[here] == 0:
            stack.extend(neighbours(here, size))
    return opened


def deduction_rounds(mines: set[Cell], size: int, start: Cell) -> list[list[Cell]] | None:
    """Rounds of cells a logic solver proves safe, until the board is clear; None if it gets stuck."""
    number = counts(mines, size)
    revealed = flood(start, mines, size, set())
    safe_total = size * size - len(mines)
    rounds: list[list[Cell]] = []
    while len(revealed) < safe_total:
        known_mines: set[Cell] = set()
        safe: set[Cell] = set()
        constraints = []
        for cell in revealed:
            hidden = [n for n in neighbours(cell, size) if n not in revealed]
            if hidden:
                constraints.append((frozenset(hidden), number[cell]))
        changed = True
        while changed:  # single-cell rules and the subset rule, to a fixed point
            changed = False
            reduced = []
            for cells, k in constraints:
                unknown = cells - known_mines - safe
                k -= len(cells & known_mines)
                if unknown and k == 0:
                    safe |= unknown
                    changed = True
                elif unknown and k == len(unknown):
                    known_mines |= unknown
                    changed = True
                elif unknown:
                    reduced.append((frozenset(unknown), k))
            for a, ka in reduced:
                for b, kb in reduced:
                    if a < b:
                        rest = b - a
                        if kb - ka == 0 and not rest <= safe:
                            safe |= rest
                            changed = True
                        elif kb - ka == len(rest) and not rest <= known_mines:
                            known_mines |= rest
                            changed = True
        new = sorted(safe - revealed)
        if not new:
            return None
        rounds.append(new)
        for cell in new:
            revealed |= flood(cell, mines, size, revealed)
    return rounds


def render(size: int, revealed: set[Cell], number: dict[Cell, int]) -> str:
    header = "   " + " ".join(str(c) for c in range(size))
    rows = [f"{r}  " + " ".join(str(number[(r, c)]) if (r, c) in revealed else "?" for c in range(size))
            for r in range(size)]
    return "\n".join([header, *rows])


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    size, density = int(context["size"]), float(context["density"])
    n_mines = max(1, round(size * size * density))
    cells = [(r, c) for r in range(size) for c in range(size)]
    for _ in range(2000):
        start = rng.choice(cells)
        mines = set(rng.sample([c for c in cells if c != start and c not in neighbours(start, size)], n_mines))
        rounds = deduction_rounds(mines, size, start)
        if rounds:  # solvable by logic, and not already cleared by the first reveal
            revealed = flood(start, mines, size, set())
            board = render(size, revealed, counts(mines, size))
            prompt = (f"Minesweeper, {size}x{size}, {n_mines} mines. ? is hidden; a digit counts the mines "
                      f"around that cell. Reveal every safe cell.\n{board}")
            return prompt, str(n_mines), {"mines": [list(c) for c in sorted(mines)], "start": list(start),
                                          "rounds": [[list(c) for c in r] for r in rounds]}
    raise EnvError(f"could not make a minesweeper board solvable by logic for {context}")


@register("minesweeper")
class MinesweeperEnv(ToolAnswerEnv):
    """Reveal every safe cell through the ``reveal`` tool; a mine ends the episode."""

    name: ClassVar[str] = "minesweeper"
    system_prompt: ClassVar[str] = 'Reveal safe cells with the reveal tool, e.g. cells "0,3; 1,3".'
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("size", "int", low=4, high=5, default=4, ood_low=6, ood_high=7, description="rows and columns"),
        ContextParam("density", "float", low=0.1, high=0.2, default=0.15, ood_low=0.1, ood_high=0.2,
                     description="fraction of cells that hold a mine"),
    ])
    required_data: ClassVar[tuple[str, ...]] = ("mines", "start", "rounds")
    names_actions: ClassVar[bool] = True
    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        return [Tool(name="reveal", description='Reveal cells given as "row,col" pairs separated by ";".',
                     parameters={"type": "object", "properties": {"cells": {"type": "string"}}, "required": ["cells"]},
                     fn=self._reveal, timeout_s=5.0)]

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        messages = super().reset(task, seed=seed)
        self._size = task.context["size"]
        self._mines = {tuple(c) for c in task.data["mines"]}
        self._number = counts(self._mines, self._size)
        self._revealed = flood(tuple(task.data["start"]), self._mines, self._size, set())
        self._exploded = False
        return messages

    @property
    def cleared(self) -> bool:
        return len(self._revealed) == self._size * self._size - len(self._mines)

    def _reveal(self, cells: str) -> str:
        if self._task is None or self._exploded:
            raise EnvError("reveal outside an episode")
        targets = []
        for part in cells.replace("(", "").replace(")", "").split(";"):
            if not part.strip():
                continue
            try:
                r, c = (int(x) for x in part.split(","))
            except ValueError:
                raise ValueError(f'cells must be "row,col" pairs separated by ";", got {part.strip()!r}') from None
            if not (0 <= r < self._size and 0 <= c < self._size):
                raise ValueError(f"cell {r},{c} is off the {self._size}x{self._size} board")
            targets.append((r, c))
        if not targets:
            raise ValueError('give at least one cell, e.g. "0,3"')
        for cell in targets:
            self.note_action(f"reveal {cell[0]},{cell[1]}", failed=cell in self._mines)
            if cell in self._mines:
                self._exploded = True
                return f"BOOM: {cell[0]},{cell[1]} was a mine."
            self._revealed |= flood(cell, self._mines, self._size, self._revealed)
        return render(self._size, self._revealed, self._number)

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """The logic solver's rounds of safe cells, one reveal call per round."""
        rounds = task.data.get("rounds")
        if not rounds:
            raise EnvError(f"task {task.id} has no data['rounds']; draw minesweeper tasks with sample_tasks")
        return [format_tool_call("reveal", {"cells": "; ".join(f"{r},{c}" for r, c in cells)}) for cells in rounds]

    @classmethod
    def failure(cls, task: Task) -> list[str]:
        """A scripted mistake for trial demos: the first round's safe cells, then a mine, in one call."""
        mines, rounds = task.data.get("mines"), task.data.get("rounds")
        if not mines or not rounds:
            raise EnvError(f"task {task.id} lacks data['mines'] / data['rounds']; draw tasks with sample_tasks")
        r, c = random.Random(task.id).choice(mines)
        cells = [f"{x},{y}" for x, y in rounds[0]] + [f"{r},{c}"]
        return [format_tool_call("reveal", {"cells": "; ".join(cells)})]

    @classmethod
    def reflection(cls, task: Task, messages: list[Message]) -> str:
        """What a failed attempt teaches, from its conversation: the mine it hit, if any."""
        boom = next((m.content for m in reversed(messages) if m.role == "tool" and m.content.startswith("BOOM")), None)
        if boom is not None:
            cell = boom.removeprefix("BOOM: ").split(" ")[0]
            return f"{cell} was a mine. Next time: avoid {cell}, reveal only proven safe cells."
        return "The board was not cleared. Next time: reveal every proven safe cell."

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return self.cleared, {}

    def tool_outcome(self) -> bool | None:
        if self._exploded:
            return False
        return True if self.cleared else None
