"""Few-shot demonstrations in a rollout's prompt: what a demo is, where it goes, where demos come from.

A ``Demo`` is a solved task: its prompt and the conversation that solved it (assistant turns and
the observations that answered them). ``with_demos`` writes demos as plain text into the first
user message, before the task, so they are part of the prompt the agent loop renders: context,
loss mask 0, never trained. How many demos an episode gets, and which, is the annealing
schedule's business (``ctxrl.meta.anneal``); evaluation gets none.

Demos come from the environment's ``solve()`` on training tasks (``solved_demos``: played through
the real agent loop with a ``ScriptedEngine``, so the observations are the environment's own) or
from a JSONL file (``load_demos``). ``demos_excluding`` leaves out the task being played: a demo
of the task itself would hand over its answer.

This module does not decide anything about schedules or evaluation, and it does not train.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from ctxrl.plain import PlainData
from ctxrl.prompts import DEMOS_HEADER, TASK_HEADER
from ctxrl.types import Message, Task

_ROLE_NAMES = {"assistant": "Assistant", "tool": "Tool", "user": "User"}


@dataclass(frozen=True)
class Demo(PlainData):
    """One solved task, as shown in a prompt."""

    task_id: str
    prompt: str
    messages: list[Message] = field(default_factory=list)
    """The solving conversation after the task: assistant turns and the observations that answered them."""


def demo_text(demo: Demo, number: int) -> str:
    """``Example N.`` then the task and each message of the solution, one ``Role: content`` line each."""
    lines = [f"Example {number}.", f"Task: {demo.prompt.strip()}"]
    for message in demo.messages:
        lines.append(f"{_ROLE_NAMES.get(message.role, message.role.title())}: {message.content.strip()}")
    return "\n".join(lines)


def with_demos(opening: list[Message], demos: list[Demo]) -> list[Message]:
    """``opening`` with ``demos`` written before the task in its first user message (unchanged if none)."""
    if not demos:
        return list(opening)
    index = next((i for i, m in enumerate(opening) if m.role == "user"), None)
    if index is None:
        raise ValueError("the episode's opening messages have no user message (the task) to put demos before")
    block = "\n\n".join([DEMOS_HEADER, *(demo_text(d, n) for n, d in enumerate(demos, start=1))])
    task = opening[index]
    out = list(opening)
    out[index] = Message(role="user", content=f"{block}\n\n{TASK_HEADER}\n{task.content}")
    return out


def demos_excluding(pool: list[Demo], task: Task) -> list[Demo]:
    """The pool without demos of ``task`` (same id or same prompt): a demo must never hold the answer played."""
    return [d for d in pool if d.task_id != task.id and d.prompt.strip() != task.prompt.strip()]


def load_demos(path: str | Path) -> list[Demo]:
    """Demos from a JSONL file, one per line: ``{"prompt": ..., "messages": [{"role", "content"}, ...]}``
    (``"id"`` optional). The messages are the solution after the task, e.g. one assistant message."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"demonstration file {str(path)!r} does not exist (meta.demos.source)")
    demos = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            messages = [Message(role=str(m["role"]), content=str(m["content"])) for m in row["messages"]]
            demos.append(Demo(task_id=str(row.get("id", f"{path.name}:{number}")), prompt=str(row["prompt"]),
                              messages=messages))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: a demonstration line must be a JSON object with \"prompt\" (text) and "
                             f"\"messages\" (a list of {{\"role\", \"content\"}}): {exc}") from None
    if not demos:
        raise ValueError(f"demonstration file {path} holds no demonstrations")
    return demos


async def _solved(env_cls, task: Task, renderer, limits) -> Demo | None:
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.rollout.agent import run_episode

    engine = ScriptedEngine(env_cls.solve(task), renderer)
    episode = await run_episode(env_cls(), task, engine, renderer, limits, seed=0)
    if not episode.success or episode.truncation is not None:
        return None
    opening = next(i for i, m in enumerate(episode.messages) if m.role == "user")
    return Demo(task_id=task.id, prompt=task.prompt, messages=list(episode.messages[opening + 1:]))


def solved_demos(env_cls, renderer, n: int, seed: int) -> list[Demo]:
    """Up to ``n`` demos from ``env_cls.solve`` on ``n`` training tasks (a script that fails is left out).

    The conversation kept ends with the last assistant turn: the observations of the step that
    ended the episode are not shown to the policy in a rollout either.
    """
    from ctxrl.rollout.spec import RolloutLimits

    limits = RolloutLimits(max_turns=16, max_new_tokens=4096, max_total_tokens=1 << 20)
    tasks = env_cls.sample_tasks("train", n, seed)

    async def play() -> list[Demo | None]:
        return list(await asyncio.gather(*(_solved(env_cls, t, renderer, limits) for t in tasks)))

    demos = [d for d in asyncio.run(play()) if d is not None]
    if not demos:
        raise RuntimeError(f"none of {n} scripted solutions of {getattr(env_cls, 'name', env_cls)} succeeded; "
                           "check the environment's solve()")
    return demos
