"""The ``sokoban`` environment: push every box onto a goal on a small text grid.

The board is shown as text (``#`` wall, ``.`` goal, ``$`` box, ``*`` box on a goal, ``@`` player,
``+`` player on a goal). The ``move`` tool takes a string of moves (``U``, ``D``, ``L``, ``R``),
plays them in order, and returns the new board; a move into a wall, or a push into a wall or a
box, stops there with an ``Error:`` observation. The episode ends (reward 1) as soon as every box
is on a goal, or when the agent answers without a call (reward 0 unless solved). RAGEN and LaMer
train on this kind of puzzle; it rewards planning over several turns.

Levels are made by *reverse play* (boxes start on the goals and the player pulls them away), so
every level is solvable; ``solve()`` is the shortest push sequence found by breadth-first
search. Context: ``size`` (interior width and height, train 4-5, ood 6) and ``boxes`` (train 1,
ood 1-2).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool
from ctxrl.types import Message, Task

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
Pos = tuple[int, int]


def render(walls: set[Pos], goals: set[Pos], boxes: set[Pos], player: Pos, height: int, width: int) -> str:
    rows = []
    for r in range(height):
        row = ""
        for c in range(width):
            p = (r, c)
            if p in walls:
                row += "#"
            elif p == player:
                row += "+" if p in goals else "@"
            elif p in boxes:
                row += "*" if p in goals else "$"
            else:
                row += "." if p in goals else " "
        rows.append(row.rstrip())
    return "\n".join(rows)


def parse(board: str) -> tuple[set[Pos], set[Pos], set[Pos], Pos, int, int]:
    """(walls, goals, boxes, player, height, width) of a rendered board."""
    lines = board.split("\n")
    width = max(len(line) for line in lines)
    walls, goals, boxes, player = set(), set(), set(), None
    for r, line in enumerate(lines):
        for c, ch in enumerate(line):
            if ch == "#":
                walls.add((r, c))
            if ch in ".*+":
                goals.add((r, c))
            if ch in "$*":
                boxes.add((r, c))
            if ch in "@+":
                player = (r, c)
    if player is None:
        raise EnvError("board has no player")
    return walls, goals, boxes, player, len(lines), width


def step_move(walls: set[Pos], boxes: frozenset[Pos], player: Pos, move: str) -> tuple[frozenset[Pos], Pos] | None:
    """The state after one move, or None if it is blocked."""
    dr, dc = MOVES[move]
    nxt = (player[0] + dr, player[1] + dc)
    if nxt in walls:
        return None
    if nxt in boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if beyond in walls or beyond in boxes:
            return None
        return (boxes - {nxt}) | {beyond}, nxt
    return boxes, nxt


def shortest_solution(walls: set[Pos], goals: set[Pos], boxes: set[Pos], player: Pos,
                      limit: int = 200_000) -> str | None:
    """Breadth-first search over (boxes, player); the fewest moves, or None if unsolvable."""
    start = (frozenset(boxes), player)
    seen = {start: ""}
    queue = deque([start])
    while queue and len(seen) < limit:
        state = queue.popleft()
        path = seen[state]
        if state[0] <= goals:
            return path
        for move in "UDLR":
            nxt = step_move(walls, state[0], state[1], move)
            if nxt is not None and nxt not in seen:
                seen[nxt] = path + move
                queue.append(nxt)
    return None


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """A level by reverse play from the solved state; the answer is its shortest solution."""
    size, n_boxes = int(context["size"]), int(context["boxes"])
    height = width = size + 2
    for _ in range(1000):
        walls = {(r, c) for r in range(height) for c in range(width) if r in (0, height - 1) or c in (0, width - 1)}
        inner = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
        for p in rng.sample(inner, rng.randrange(0, max(1, size - 2))):  # a few inner walls
            walls.add(p)
        free = [p for p in inner if p not in walls]
        if len(free) < n_boxes + 2:
            continue
        goals = set(rng.sample(free, n_boxes))
        boxes = set(goals)
        player = rng.choice([p for p in free if p not in boxes])
        for _ in range(rng.randrange(8, 30)):  # reverse play: walk, and pull a box behind you
            dr, dc = MOVES[rng.choice("UDLR")]
            nxt, behind = (player[0] + dr, player[1] + dc), (player[0] - dr, player[1] - dc)
            if nxt in walls or nxt in boxes:
                continue
            if behind in boxes and rng.random() < 0.7:
                boxes = (boxes - {behind}) | {player}
            player = nxt
        if boxes & goals == boxes:
            continue  # still solved: try again
        solution = shortest_solution(walls, goals, boxes, player)
        if solution and len(solution) >= 2:
            board = render(walls, goals, boxes, player, height, width)
            prompt = ("Push every box ($) onto a goal (.). # is a wall, @ is you, * is a box on a goal.\n"
                      f"{board}")
            return prompt, solution, {"board": board}
    raise EnvError(f"could not make a sokoban level for {context}")


@register("sokoban")
class SokobanEnv(ToolAnswerEnv):
    """Push boxes onto goals with the ``move`` tool; reward 1 once all boxes are on goals."""

    name: ClassVar[str] = "sokoban"
    system_prompt: ClassVar[str] = "Solve the puzzle with the move tool (a string of U, D, L, R)."
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("size", "int", low=4, high=5, default=4, ood_low=6, ood_high=6,
                     description="interior width and height of the grid"),
        ContextParam("boxes", "int", low=1, high=1, default=1, ood_low=1, ood_high=2, description="boxes to place"),
    ])
    required_data: ClassVar[tuple[str, ...]] = ("board",)
    generate = staticmethod(generate)

    def make_tools(self) -> list[Tool]:
        return [Tool(name="move", description="Make moves (a string of U, D, L, R); returns the board.",
                     parameters={"type": "object", "properties": {"moves": {"type": "string"}}, "required": ["moves"]},
                     fn=self._move, timeout_s=5.0)]

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        messages = super().reset(task, seed=seed)
        self._walls, self._goals, boxes, self._player, self._h, self._w = parse(task.data["board"])
        self._boxes = frozenset(boxes)
        return messages

    def _board(self) -> str:
        return render(self._walls, self._goals, set(self._boxes), self._player, self._h, self._w)

    def _move(self, moves: str) -> str:
        if self._task is None:
            raise EnvError("move before reset")
        moves = moves.strip().upper().replace(" ", "").replace(",", "")
        bad = sorted(set(moves) - set(MOVES))
        if not moves or bad:
            raise ValueError(f"moves must be a string of U, D, L, R; got {moves!r}")
        for i, move in enumerate(moves):
            nxt = step_move(self._walls, self._boxes, self._player, move)
            if nxt is None:
                raise ValueError(f"move {i + 1} ({move}) is blocked; the board after {i} moves:\n{self._board()}")
            self._boxes, self._player = nxt
            if self.solved:
                break
        return self._board()

    @property
    def solved(self) -> bool:
        return self._boxes <= self._goals

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """One ``move`` call with the shortest solution (the task's answer)."""
        if not task.answer:
            raise EnvError(f"task {task.id} has no solution in task.answer")
        return [format_tool_call("move", {"moves": task.answer})]

    def check_answer(self, given: str, task: Task) -> tuple[bool, dict[str, Any]]:
        return self.solved, {}

    def tool_outcome(self) -> bool | None:
        return True if self.solved else None
