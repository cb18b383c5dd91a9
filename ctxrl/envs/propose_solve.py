"""``propose_solve``: one seat proposes an arithmetic problem, the solver seats solve it; the proposer is paid
for problems at the solvers' edge.

Roles: ``proposer`` (one seat) and ``solver`` (``[env.propose_solve] solvers`` seats, ``solver/0`` ...,
four by default). The proposer writes ``<problem>EXPRESSION</problem>``: whole numbers of at most ``digits``
digits joined by 1 to ``ops`` of ``+``, ``-``, ``*`` (the task's context). The environment computes its value
(so the problem is verifiable), and each solver, seeing only the expression, answers ``<answer>N</answer>``
without tools: reward 1 if right. With ``p`` the fraction of solvers right, the proposer earns R-Zero's
uncertainty reward ``1 - 2|p - 1/2|`` (Huang et al. 2025): 1 for a problem half the solvers solve, 0 for one
all or none solve. A proposal that is not such a problem earns the proposer -1 and ends the match (the
solvers never play). ``success``: a solver that was right; a proposer whose problem was at the edge (0 < p < 1).

Solvers are seats of one role, so with ``rollout.group_size = G`` a solver's baseline is the other solvers of
the task's G matches (``Episode.baseline_group``).

Tasks carry a reference problem (``data["expression"]``, drawn as the calculator environment draws its
expressions): ``solve`` proposes it and answers it right (the proposer's gold reward is then 0: every solver
solves it), and the scripted proposer ``given`` (``opponents()``) proposes it, which makes an evaluation with
``roles.eval_opponents = ["scripted:given"]`` the solvers' accuracy on fixed held-out problems. Splits:
``train`` and ``heldout`` ask for 1-2 digits, ``ood`` for 3; 1-2 operations everywhere.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ctxrl.envs.base import EnvError
from ctxrl.envs.calculator import answers_equal
from ctxrl.envs.calculator import generate as calculator_problem
from ctxrl.envs.registry import register
from ctxrl.envs.roles import plays, seat_name
from ctxrl.envs.tool_answer import parse_answer
from ctxrl.settings import POSITIVE, in_range
from ctxrl.tasks.space import ContextParam, ContextSpace, sample_tasks
from ctxrl.tools.calculator import CalculatorError, calculate
from ctxrl.types import Message, TableStep, Task

PROPOSER, SOLVER = "proposer", "solver"
INVALID_PROPOSAL = -1.0
_PROBLEM = re.compile(r"<problem>(.*?)</problem>", re.DOTALL)
_EXPRESSION = re.compile(r"^\s*(\d+)((?:\s*[-+*]\s*\d+)*)\s*$")


@dataclass(frozen=True)
class ProposeSolveSettings:
    """``[env.propose_solve]``."""

    solvers: int = field(default=4, metadata={**POSITIVE, **in_range(1, 16)})
    """Solver seats per match: the proposer's reward is the fraction of them that solve its problem."""


def edge_reward(solved: int, solvers: int) -> float:
    """R-Zero's uncertainty reward of a problem ``solved`` of ``solvers`` solve: ``1 - 2|p - 1/2|``."""
    return 1.0 - 2.0 * abs(solved / solvers - 0.5)


def check_problem(text: str, digits: int, ops: int) -> tuple[str | None, str]:
    """``(expression, value)`` of a proposal within the limits, or ``(None, why not)``."""
    found = _PROBLEM.findall(text)
    if not found:
        return None, "no <problem>...</problem>"
    match = _EXPRESSION.match(found[-1])
    if not match:
        return None, "not whole numbers joined by +, -, *"
    numbers = re.findall(r"\d+", found[-1])
    if not 2 <= len(numbers) <= ops + 1:
        return None, f"needs 1 to {ops} operations"
    if any(len(n.lstrip("0") or "0") > digits for n in numbers):
        return None, f"numbers of more than {digits} digits"
    expression = " ".join(re.findall(r"\d+|[-+*]", found[-1]))
    try:
        return expression, calculate(expression)
    except CalculatorError as exc:
        return None, str(exc)


@plays(PROPOSER)
def propose_reference(view: dict[str, Any], rng: random.Random) -> str:
    """The scripted proposer ``given``: the task's reference problem."""
    return f"<problem>{view['reference']}</problem>"


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """The limits of the proposal, and a reference problem within them (``data["expression"]``)."""
    _, value, data = calculator_problem(context, rng)
    prompt = (f"propose a problem with numbers of up to {context['digits']} digits and up to {context['ops']} "
              f"operations (reference: {data['expression']})")
    return prompt, value, {"expression": data["expression"]}


@register("propose_solve")
class ProposeSolveEnv:
    """A proposer writes arithmetic problems for solver seats; paid for problems at their edge."""

    name: ClassVar[str] = "propose_solve"
    roles: ClassVar[tuple[str, ...]] = (PROPOSER, SOLVER)
    Settings: ClassVar[type] = ProposeSolveSettings
    options: ClassVar[ProposeSolveSettings] = ProposeSolveSettings()
    system_prompt: ClassVar[str] = "You are the {role}."
    proposer_prompt: ClassVar[str] = ("You are the proposer. Write one arithmetic problem that the solvers solve about "
                                      "half of the time, as <problem>EXPRESSION</problem>.")
    solver_prompt: ClassVar[str] = "You are {seat}, a solver. Compute the value. Reply with <answer>N</answer>."
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("digits", "int", low=1, high=2, default=2, ood_low=3, ood_high=3,
                     description="most digits of a number in a proposed problem"),
        ContextParam("ops", "int", low=1, high=2, default=1, ood_low=1, ood_high=2,
                     description="most operations (+, -, *) in a proposed problem"),
    ])

    def __init__(self) -> None:
        self.tools: list = []
        self._task: Task | None = None
        self._seats: list[str] = []
        self._turn = 0
        self._problem: tuple[str, str] | None = None
        self._solved = 0
        self._over = False

    @classmethod
    def seats(cls) -> list[str]:
        return [PROPOSER, *(seat_name(SOLVER, k) for k in range(cls.options.solvers))]

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        return sample_tasks(generate, cls.context_space, split, n, seed, heldout_fraction=cls.heldout_fraction,
                            id_prefix=cls.name)

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """Propose the reference problem; every solver answers it right."""
        return [f"<problem>{_expression(task)}</problem>"] + [f"<answer>{task.answer}</answer>"] * cls.options.solvers

    @classmethod
    def gold_rewards(cls, task: Task) -> dict[str, float]:
        n = cls.options.solvers
        return {PROPOSER: edge_reward(n, n), **{seat_name(SOLVER, k): 1.0 for k in range(n)}}

    @classmethod
    def opponents(cls) -> dict[str, Any]:
        return {"given": propose_reference}

    def reset(self, task: Task, *, seed: int | None = None) -> dict[str, list[Message]]:
        _expression(task)
        self._task, self._seats, self._turn = task, self.seats(), 0
        self._problem, self._solved, self._over = None, 0, False
        limits = f"Use numbers of up to {task.context['digits']} digits and 1 to {task.context['ops']} operations."
        openings = {PROPOSER: [Message("system", self.proposer_prompt), Message("user", limits)]}
        for seat in self._seats[1:]:
            openings[seat] = [Message("system", self.solver_prompt.format(seat=seat)),
                              Message("user", "A problem follows.")]
        return openings

    def to_act(self) -> str:
        self._check_live()
        return self._seats[self._turn]

    def view(self, seat: str) -> dict[str, Any]:
        self._check_live()
        if seat == PROPOSER:
            return {"seat": seat, "reference": self._task.data["expression"], **self._task.context}
        return {"seat": seat, "problem": self._problem[0] if self._problem else None}

    async def step(self, message: Message) -> TableStep:
        seat = self.to_act()
        self._turn += 1
        if seat == PROPOSER:
            return self._proposal(message.content)
        correct = answers_equal(parse_answer(message.content) or "", self._problem[1])
        self._solved += correct
        rewards = {seat: 1.0 if correct else 0.0}
        info = {"answered": parse_answer(message.content) is not None, "correct": correct}
        if self._turn < len(self._seats):
            return TableStep(rewards=rewards, info=info)
        self._over = True
        edge = edge_reward(self._solved, len(self._seats) - 1)
        return TableStep(rewards={**rewards, PROPOSER: edge}, terminated=True, info=info,
                         outcome={PROPOSER: 0.0 < edge})

    def _proposal(self, text: str) -> TableStep:
        expression, value = check_problem(text, int(self._task.context["digits"]), int(self._task.context["ops"]))
        if expression is None:
            self._over = True
            return TableStep(rewards={PROPOSER: INVALID_PROPOSAL}, terminated=True,
                             info={"answered": False, "invalid": value}, outcome={PROPOSER: False})
        self._problem = (expression, value)
        ask = [Message("user", f"Solve: {expression}")]
        return TableStep(messages={seat: list(ask) for seat in self._seats[1:]}, info={"answered": True})

    def close(self) -> None:
        pass

    def _check_live(self) -> None:
        if self._task is None:
            raise EnvError("propose_solve: reset(task) first")
        if self._over:
            raise EnvError("propose_solve: the match is over; call reset(task) to start another")


def _expression(task: Task) -> str:
    expression = task.data.get("expression")
    if not isinstance(expression, str):
        raise EnvError(f"task {task.id} lacks data['expression']; draw propose_solve tasks with sample_tasks")
    return expression
