"""Minesweeper: counts and flood fill by hand, logic-only solvability, the reveal tool, episode ends."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.chat.toolcalls import format_tool_call, parse_assistant
from ctxrl.envs import assert_env_ok, get_env_class
from ctxrl.envs.minesweeper import MinesweeperEnv, counts, deduction_rounds, flood, neighbours, render


def test_counts_flood_and_render_by_hand():
    mines = {(0, 3)}
    number = counts(mines, 4)
    assert number[(0, 2)] == 1 and number[(1, 3)] == 1 and number[(1, 2)] == 1 and number[(3, 0)] == 0
    assert len(neighbours((0, 0), 4)) == 3 and len(neighbours((1, 1), 4)) == 8
    opened = flood((3, 0), mines, 4, set())
    assert opened == {(r, c) for r in range(4) for c in range(4)} - {(0, 3)}  # one zero region opens all
    assert render(4, {(0, 2)}, number).splitlines()[1] == "0  ? ? 1 ?"
    # one mine in the corner: revealing the far corner clears the board at once -> nothing left to deduce
    assert deduction_rounds(mines, 4, (3, 0)) == []


def test_deduction_is_sound_and_sometimes_stuck():
    import random

    rng = random.Random(0)
    stuck = 0
    for _ in range(300):
        start = (rng.randrange(5), rng.randrange(5))
        free = [(r, c) for r in range(5) for c in range(5) if (r, c) != start and (r, c) not in neighbours(start, 5)]
        mines = set(rng.sample(free, 4))
        rounds = deduction_rounds(mines, 5, start)
        if rounds is None:
            stuck += 1  # a guess would be needed: the generator throws such boards away
        else:
            assert all(cell not in mines for rnd in rounds for cell in rnd)
    assert 0 < stuck < 300


@pytest.mark.parametrize("split,size", [("train", (4, 5)), ("ood", (6, 7))])
def test_generated_boards_are_cleared_by_logic(split, size):
    for task in MinesweeperEnv.sample_tasks(split, 20, seed=1):
        assert size[0] <= task.context["size"] <= size[1]
        mines = {tuple(c) for c in task.data["mines"]}
        n = task.context["size"]
        revealed = flood(tuple(task.data["start"]), mines, n, set())
        assert task.data["rounds"]  # something is left to do after the first reveal
        for rnd in task.data["rounds"]:
            for cell in map(tuple, rnd):
                assert cell not in mines  # the solver never guesses
                revealed |= flood(cell, mines, n, revealed)
        assert len(revealed) == n * n - len(mines)


def test_reveal_tool_and_episode_ends():
    assert_env_ok(MinesweeperEnv, n_tasks=8)
    assert get_env_class("minesweeper") is MinesweeperEnv
    task = MinesweeperEnv.sample_tasks("train", 1, seed=3)[0]
    env = MinesweeperEnv()
    env.reset(task)
    bad = asyncio.run(env.step(parse_assistant(format_tool_call("reveal", {"cells": "a,b"}))))
    assert "row,col" in bad.messages[0].content and not bad.terminated
    off = asyncio.run(env.step(parse_assistant(format_tool_call("reveal", {"cells": "9,9"}))))
    assert "off the" in off.messages[0].content
    mine = task.data["mines"][0]
    boom = asyncio.run(env.step(parse_assistant(format_tool_call("reveal", {"cells": f"{mine[0]},{mine[1]}"}))))
    assert boom.terminated and boom.reward == 0.0 and boom.messages[0].content.startswith("BOOM")
    env.reset(task)
    results = [asyncio.run(env.step(parse_assistant(text))) for text in MinesweeperEnv.solve(task)]
    assert results[-1].terminated and results[-1].reward == 1.0
    assert all(not r.terminated for r in results[:-1])


def test_each_revealed_cell_is_an_action_and_the_mine_is_the_failed_one():
    task = MinesweeperEnv.sample_tasks("train", 1, seed=3)[0]
    safe = next(tuple(c) for c in task.data["rounds"][0])
    mine = tuple(task.data["mines"][0])
    env = MinesweeperEnv()
    env.reset(task)
    cells = f"{safe[0]},{safe[1]}; {mine[0]},{mine[1]}; {safe[0]},{safe[1]}"  # stops at the mine
    result = asyncio.run(env.step(parse_assistant(format_tool_call("reveal", {"cells": cells}))))
    assert result.terminated and result.reward == 0.0
    assert result.info["actions"] == [f"reveal {safe[0]},{safe[1]}", f"reveal {mine[0]},{mine[1]}"]
    assert result.info["failed_actions"] == [f"reveal {mine[0]},{mine[1]}"]
    env.reset(task)  # a new episode forgets the old one's actions; a call that reveals nothing names none
    bad = asyncio.run(env.step(parse_assistant(format_tool_call("reveal", {"cells": "9,9"}))))
    assert "actions" not in bad.info and "failed_actions" not in bad.info
