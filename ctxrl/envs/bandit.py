"""The ``bandit`` environment: multi-armed and contextual Bernoulli bandits, pulled through a tool.

The agent has ``horizon`` pulls of ``arms`` slot machines. Each turn it calls ``pull(arm)`` and
sees the sampled reward (``reward 1`` / ``reward 0``); in the contextual variant each turn also
shows a colour, and which arm pays best depends on it. Learning *within* the episode from the
outcomes is the whole task: the substrate of in-context RL (EVOLvE, in-context bandit work).

Reward (deterministic, so training is not at the mercy of coin flips): one minus the normalised
pseudo-regret, ``1 - sum_t (p_best(t) - p_chosen(t)) / sum_t (p_best(t) - p_mean(t))``: 1 for
always pulling the best arm, about 0 for pulling uniformly at random, clipped at -1. A turn
without a valid pull wastes that pull (regret ``p_best``). The sampled rewards the agent sees
come from the episode's seed. ``info`` reports ``regret`` (pseudo-regret), ``pulls``,
``best_arm_rate`` and ``sampled_reward``; ``success`` is reward >= 0.5. Each pull is an action
(``pull 2``, ``pull 2 on red``); a pull of an arm that is not the best (for its colour) is a failed
one (``info["failed_actions"]``): what the exploration statistics count when a later attempt of a
trial pulls it again.

Context: ``arms`` (train 2-4, ood 5-6), ``horizon`` (train 4-8, ood 12-16 pulls), ``gap``
(probability gap between the best arm and the others, 0.3-0.6 everywhere), ``contextual``
(false / true).
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, ClassVar

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.envs.tool_answer import ToolAnswerEnv
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.tools.base import Tool, execute_tool_calls
from ctxrl.types import Message, StepResult, Task

COLOURS = ("red", "blue")


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """Arm probabilities (one row per colour if contextual), the colour sequence, the prompt."""
    arms, horizon, gap = int(context["arms"]), int(context["horizon"]), float(context["gap"])
    contextual = bool(context["contextual"])
    rows: list[list[float]] = []
    for _ in COLOURS if contextual else COLOURS[:1]:
        taken = {max(range(arms), key=r.__getitem__) for r in rows}  # each colour has its own best arm
        best = rng.choice([a for a in range(arms) if a not in taken])
        high = round(rng.uniform(0.5 + gap / 2, 0.95), 2)
        # rounded down, so every other arm stays at least ``gap`` below the best
        probs = [max(0.0, math.floor((high - gap - rng.uniform(0.0, 0.1)) * 100) / 100) for _ in range(arms)]
        probs[best] = high
        rows.append(probs)
    colours = [rng.choice(COLOURS) for _ in range(horizon)] if contextual else []
    prompt = (f"There are {arms} slot machines, arms 0 to {arms - 1}. You have {horizon} pulls. "
              + ("Before each pull you see a colour; which arm pays best depends on it. " if contextual else "")
              + "Call pull with an arm each turn to win as often as you can.")
    answer = ",".join(str(max(range(arms), key=row.__getitem__)) for row in rows)
    return prompt, answer, {"probs": rows, "colours": colours}


@register("bandit")
class BanditEnv(ToolAnswerEnv):
    """Pull arms through the ``pull`` tool; reward 1 minus the normalised pseudo-regret."""

    name: ClassVar[str] = "bandit"
    system_prompt: ClassVar[str] = "Pull one arm per turn with the pull tool."
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("arms", "int", low=2, high=4, default=3, ood_low=5, ood_high=6, description="number of arms"),
        ContextParam("horizon", "int", low=4, high=8, default=6, ood_low=12, ood_high=16,
                     description="pulls per episode (one per turn)"),
        ContextParam("gap", "float", low=0.3, high=0.6, default=0.4, ood_low=0.3, ood_high=0.6,
                     description="probability gap between the best arm and the others"),
        ContextParam("contextual", "choice", choices=(False, True), default=False,
                     description="a colour before each pull decides the best arm"),
    ])

    required_data: ClassVar[tuple[str, ...]] = ("probs", "colours")
    names_actions: ClassVar[bool] = True
    generate = staticmethod(generate)

    def __init__(self) -> None:
        super().__init__()
        self._rng = random.Random(0)
        self._t = 0
        self._regret = self._scale = self._sampled = 0.0
        self._best_pulls = 0

    def make_tools(self) -> list[Tool]:
        return [Tool(name="pull", description="Pull one arm; returns its reward (0 or 1).",
                     parameters={"type": "object", "properties": {"arm": {"type": "integer"}}, "required": ["arm"]},
                     fn=self._pull, timeout_s=5.0)]

    # -- the arms --------------------------------------------------------------------------------
    def _row(self) -> list[float]:
        assert self._task is not None
        colours = self._task.data["colours"]
        probs = self._task.data["probs"]
        return probs[COLOURS.index(colours[self._t])] if colours else probs[0]

    def _charge(self, p_chosen: float, row: list[float]) -> None:
        best = max(row)
        self._regret += best - p_chosen
        self._scale += best - sum(row) / len(row)
        self._best_pulls += int(p_chosen == best)
        self._t += 1

    def _pull(self, arm: int) -> str:
        if self._task is None or self._terminated:
            raise EnvError("pull outside an episode")
        row = self._row()
        arm = int(arm)
        if not 0 <= arm < len(row):
            raise ValueError(f"arm must be 0..{len(row) - 1}, got {arm}")
        colour = self._colour_line().removeprefix("\nColour: ")
        self.note_action(f"pull {arm}" + (f" on {colour}" if colour else ""), failed=row[arm] < max(row))
        win = self._rng.random() < row[arm]
        self._sampled += win
        self._charge(row[arm], row)
        return f"reward {int(win)}"

    # -- the protocol ----------------------------------------------------------------------------
    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """The oracle: the best arm for each turn's colour (regret 0, reward 1)."""
        probs, colours = task.data.get("probs"), task.data.get("colours")
        if probs is None or colours is None:
            raise EnvError(f"task {task.id} lacks data['probs'] / data['colours']; draw tasks with sample_tasks")
        rows = [probs[COLOURS.index(c)] for c in colours] if colours else [probs[0]] * task.context["horizon"]
        return [format_tool_call("pull", {"arm": max(range(len(r)), key=r.__getitem__)}) for r in rows]

    @classmethod
    def failure(cls, task: Task) -> list[str]:
        """Trial demos' first attempt: explore, pulling the arms in turn (about uniform: it fails)."""
        if task.data.get("probs") is None:
            raise EnvError(f"task {task.id} lacks data['probs']; draw tasks with sample_tasks")
        arms, horizon = task.context["arms"], task.context["horizon"]
        return [format_tool_call("pull", {"arm": t % arms}) for t in range(horizon)]

    @classmethod
    def reflection(cls, task: Task, messages: list[Message]) -> str:
        """What an attempt's pulls showed, from its conversation: the arm that paid most (per colour)."""
        seen: dict[str, dict[int, list[int]]] = {}  # colour ("" if none) -> arm -> rewards seen
        colour = ""
        for i, m in enumerate(messages):
            if m.role == "assistant" and m.tool_calls and i + 1 < len(messages):
                reply = messages[i + 1].content
                if reply.startswith("reward "):
                    arm = int(m.tool_calls[0].arguments.get("arm", -1))
                    seen.setdefault(colour, {}).setdefault(arm, []).append(int(reply[7]))
            if m.role in ("user", "tool") and "Colour: " in m.content:
                colour = m.content.rsplit("Colour: ", 1)[1].strip()
        if not seen:
            return "No valid pull. Next time: call pull with an arm on every turn."
        best = {c: max(sorted(arms), key=lambda a, arms=arms: sum(arms[a]) / len(arms[a])) for c, arms in seen.items()}
        if "" in best:
            return f"Arm {best['']} paid most. Next time: pull arm {best['']}."
        return "Next time: " + ", ".join(f"{c} arm {a}" for c, a in sorted(best.items())) + "."

    @classmethod
    def solve_after(cls, task: Task, reflection: str) -> list[str]:
        """Trial demos' second attempt: follow the reflection (the arm it names, per colour; arm 0 where it names
        none), so the demo shows a note being used, not the oracle."""
        plain = re.search(r"pull arm (\d+)", reflection)
        named = {c: int(a) for c, a in re.findall(r"(\w+) arm (\d+)", reflection)}
        colours = task.data.get("colours") or [""] * task.context["horizon"]
        return [format_tool_call("pull", {"arm": int(plain.group(1)) if plain else named.get(c, 0)}) for c in colours]

    def reset(self, task: Task, *, seed: int | None = None) -> list[Message]:
        """Start an episode; ``seed`` drives the sampled rewards the agent sees."""
        messages = super().reset(task, seed=seed)  # checks the task's data
        self._rng = random.Random(f"{task.id}:{seed}")
        self._t, self._regret, self._scale, self._sampled, self._best_pulls = 0, 0.0, 0.0, 0.0, 0
        messages[-1] = Message(role="user", content=task.prompt + self._colour_line())
        return messages

    def _colour_line(self) -> str:
        colours = self._task.data["colours"] if self._task else []
        return f"\nColour: {colours[self._t]}" if colours and self._t < len(colours) else ""

    async def step(self, message: Message) -> StepResult:
        """One pull per turn (only the first call counts); the last pull ends the episode."""
        if self._task is None:
            raise EnvError("step() called before reset(task); start an episode with reset first")
        if self._terminated:
            raise EnvError("step() called after the episode terminated; call reset(task) to start a new episode")
        t_before = self._t
        observations, counts = [], {"tool_calls": 0, "tool_errors": 0, "malformed_tool_calls": 0}
        if message.tool_calls or message.tool_call_errors:
            first = Message(role=message.role, content=message.content, tool_calls=message.tool_calls[:1],
                            tool_call_errors=message.tool_call_errors if not message.tool_calls else [])
            observations, counts = await execute_tool_calls(self.tools, first)
            counts = {**counts, **self.noted_actions()}
        if self._t == t_before:  # no valid pull this turn: the pull is wasted
            self._charge(0.0, self._row())
            if not observations:
                observations = [Message(role="tool", content="Error: no pull; call pull with an arm", name="pull")]
        horizon = self._task.context["horizon"]
        if self._t < horizon:
            colour = self._colour_line()
            if colour:
                observations[-1] = Message(role=observations[-1].role, content=observations[-1].content + colour,
                                           name=observations[-1].name)
            return StepResult(messages=observations, reward=0.0, terminated=False, info=counts)
        self._terminated = True
        reward = max(-1.0, 1.0 - self._regret / self._scale) if self._scale > 0 else 1.0
        info = {**counts, "regret": self._regret, "pulls": self._t, "best_arm_rate": self._best_pulls / self._t,
                "sampled_reward": self._sampled / self._t, "success": reward >= 0.5, "answered": True}
        return StepResult(messages=observations, reward=reward, terminated=True, info=info)
