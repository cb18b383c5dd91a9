"""Sokoban: board text, moves and pushes by hand, BFS solutions, generated levels, the move tool."""

from __future__ import annotations

import asyncio

import pytest

from ctxrl.chat.toolcalls import format_tool_call, parse_assistant
from ctxrl.envs import assert_env_ok, get_env_class
from ctxrl.envs.sokoban import SokobanEnv, parse, render, shortest_solution, step_move
from ctxrl.types import Message

LEVEL = "\n".join(["#######",
                   "#@ $ .#",
                   "#######"])


def test_render_and_parse_round_trip():
    walls, goals, boxes, player, h, w = parse(LEVEL)
    assert player == (1, 1) and boxes == {(1, 3)} and goals == {(1, 5)} and (h, w) == (3, 7)
    assert render(walls, goals, boxes, player, h, w) == LEVEL
    assert render(walls, goals, {(1, 5)}, (1, 4), h, w) == "#######\n#   @*#\n#######"


def test_moves_and_pushes_by_hand():
    walls, goals, boxes, player, *_ = parse(LEVEL)
    boxes = frozenset(boxes)
    assert step_move(walls, boxes, player, "L") is None                     # into a wall
    assert step_move(walls, boxes, player, "R") == (boxes, (1, 2))          # a plain step
    pushed = step_move(walls, boxes, (1, 2), "R")
    assert pushed == (frozenset({(1, 4)}), (1, 3))                          # a push
    assert step_move(walls, frozenset({(1, 5)}), (1, 4), "R") is None       # box against the wall
    two = frozenset({(1, 3), (1, 4)})
    assert step_move(walls, two, (1, 2), "R") is None                       # box against a box
    assert shortest_solution(walls, goals, {(1, 3)}, (1, 1)) == "RRR"  # step, push, push
    assert shortest_solution(walls, goals, {(1, 5)}, (1, 1)) == ""           # already solved
    assert shortest_solution(walls, {(1, 1)}, {(1, 3)}, (1, 2)) is None      # a box can't be pulled


@pytest.mark.parametrize("split,size,boxes", [("train", (4, 5), (1, 1)), ("ood", (6, 6), (1, 2))])
def test_generated_levels_are_solved_by_their_answer(split, size, boxes):
    for task in SokobanEnv.sample_tasks(split, 15, seed=2):
        assert size[0] <= task.context["size"] <= size[1] and boxes[0] <= task.context["boxes"] <= boxes[1]
        walls, goals, box_set, player, *_ = parse(task.data["board"])
        assert len(box_set) == len(goals) == task.context["boxes"] and not box_set <= goals
        state = (frozenset(box_set), player)
        for move in task.answer:
            state = step_move(walls, state[0], state[1], move)
            assert state is not None
        assert state[0] <= goals
        assert len(shortest_solution(walls, goals, box_set, player)) == len(task.answer)  # BFS: shortest


def test_move_tool_and_episode_end():
    assert_env_ok(SokobanEnv, n_tasks=8)
    assert get_env_class("sokoban") is SokobanEnv
    task = SokobanEnv.sample_tasks("train", 1, seed=5)[0]
    walls, goals, boxes, player, *_ = parse(task.data["board"])
    env = SokobanEnv()
    env.reset(task)
    blocked = next(m for m in "UDLR" if step_move(walls, frozenset(boxes), player, m) is None)
    result = asyncio.run(env.step(parse_assistant(format_tool_call("move", {"moves": blocked}))))
    assert result.messages[0].content.startswith("Error") and "is blocked" in result.messages[0].content
    assert not result.terminated and result.reward == 0.0
    bad = asyncio.run(env.step(parse_assistant(format_tool_call("move", {"moves": "UX"}))))
    assert "U, D, L, R" in bad.messages[0].content
    done = asyncio.run(env.step(parse_assistant(format_tool_call("move", {"moves": task.answer.lower()}))))
    assert done.terminated and done.reward == 1.0 and done.info["correct"]
    env.reset(task)  # giving up without solving: reward 0
    quit_ = asyncio.run(env.step(Message(role="assistant", content="<answer>done</answer>")))
    assert quit_.terminated and quit_.reward == 0.0
