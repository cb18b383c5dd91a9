"""``kuhn_poker``: two players, one card each, one betting round: the smallest poker with hidden information.

Kuhn (1950) with a deck of ``deck`` cards ranked 1 to ``deck`` (3 is the classic J, Q, K). Each player antes
one chip and is dealt one card, which the other never sees. ``player_0`` acts first: ``check`` or ``bet`` (one
chip). After a check, ``player_1`` may check (showdown for 2 chips) or bet; facing a bet, a player ``call`` s
(showdown for 4 chips) or ``fold`` s (the bettor takes the pot). The higher card wins a showdown. Each seat's
reward is the chips it won or lost (+-1 or +-2), so the game is zero-sum. A reply that is not a legal action
(the first word of the turn) loses the hand: the offender -2, the other seat 0 (as SPIRAL scores invalid
moves: the other seat is not paid for its opponent's mistake).

Each seat sees its own card and the other's moves, never the other's card; its system prompt names its
role, which is how one shared policy knows which seat it plays.

Tasks are a deal and a scripted line of play (``data["line"]``, drawn uniformly from the five legal lines):
``solve`` plays that line, so warm-start demos teach the rules and the reply format, not a strategy (the
line ignores the cards), and ``gold_rewards`` is that line's payoff, computed by ``payoff`` apart from the
step logic that ``check-env`` tests against it. Splits: ``train`` and ``heldout`` share the decks of 3 and 4
cards and never share a (deal, line); ``ood`` deals from 5 or 6 cards.

Scripted players (``opponents()``, for ``roles.policies`` and ``roles.eval_opponents``): ``random`` (a legal
action uniformly), ``nash`` (the equilibrium of the 3-card game with alpha = 1/3: the highest card bets and
calls, the lowest bluffs a third of the time and folds, the others check and call a bet two thirds of the
time first to act, one third second; with more cards the same play, which is then not an equilibrium),
``always_bet`` (bets and calls every hand) and ``always_check`` (checks, calls a bet).
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from ctxrl.envs.base import EnvError
from ctxrl.envs.registry import register
from ctxrl.tasks.space import ContextParam, ContextSpace, sample_tasks
from ctxrl.types import Message, TableStep, Task

ROLES = ("player_0", "player_1")
LINES = (("check", "check"), ("check", "bet", "call"), ("check", "bet", "fold"), ("bet", "call"), ("bet", "fold"))
"""Every legal line of play, in order of the seats' turns (player_0 first)."""
INVALID_PENALTY = -2.0


def legal_actions(history: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The actions the seat to act may take after ``history`` (none once the hand is over)."""
    if tuple(history) in ((), ("check",)):
        return ("check", "bet")
    if tuple(history) in (("bet",), ("check", "bet")):
        return ("call", "fold")
    return ()


def payoff(cards: list[int] | tuple[int, ...], line: list[str] | tuple[str, ...]) -> tuple[float, float]:
    """The chips each player wins on a finished ``line`` (a pure function of the rules, apart from ``step``)."""
    line = tuple(line)
    if line not in LINES:
        raise ValueError(f"{line} is not a finished line of Kuhn poker")
    if line[-1] == "fold":  # the player who folded loses its ante; the bettor is the other one
        folder = (len(line) - 1) % 2
        return (-1.0, 1.0) if folder == 0 else (1.0, -1.0)
    stake = 2.0 if "bet" in line else 1.0
    return (stake, -stake) if cards[0] > cards[1] else (-stake, stake)


def generate(context: dict[str, Any], rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """A deal and a scripted line: ``(prompt, answer, {"cards", "line"})``."""
    deck = int(context["deck"])
    cards = rng.sample(range(1, deck + 1), 2)
    line = list(rng.choice(LINES))
    chips = payoff(cards, line)
    prompt = (f"Kuhn poker with cards 1 to {deck}: player_0 holds {cards[0]}, player_1 holds {cards[1]}; "
              f"scripted line: {' '.join(line)}")
    return prompt, f"player_0 {chips[0]:+g}, player_1 {chips[1]:+g}", {"cards": cards, "line": line}


def _strength(view: dict[str, Any]) -> str:
    card, deck = view["card"], view["deck"]
    return "high" if card == deck else "low" if card == 1 else "middle"


def _nash(view: dict[str, Any], rng: random.Random) -> str:
    """The alpha = 1/3 equilibrium of the 3-card game (see the module docstring)."""
    strength, history, first = _strength(view), tuple(view["history"]), view["seat"] == ROLES[0]
    if "bet" not in history:  # to open, or checked to
        if strength == "high":
            return "bet"
        return "bet" if strength == "low" and rng.random() < 1 / 3 else "check"
    if strength == "high":
        return "call"
    if strength == "low":
        return "fold"
    return "call" if rng.random() < (2 / 3 if first else 1 / 3) else "fold"


OPPONENTS = {
    "random": lambda view, rng: rng.choice(view["legal"]),
    "nash": _nash,
    "always_bet": lambda view, rng: "bet" if "bet" in view["legal"] else "call",
    "always_check": lambda view, rng: "check" if "check" in view["legal"] else "call",
}


@register("kuhn_poker")
class KuhnPokerEnv:
    """Two-player Kuhn poker; reward: the chips each seat wins (zero-sum)."""

    name: ClassVar[str] = "kuhn_poker"
    roles: ClassVar[tuple[str, ...]] = ROLES
    zero_sum: ClassVar[bool] = True
    system_prompt: ClassVar[str] = ("You are {seat} in Kuhn poker with cards 1 to {deck}; the higher card wins. "
                                    "Each player antes 1 chip. Reply with one word: check, bet, call or fold.")
    heldout_fraction: ClassVar[float] = 0.2
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("deck", "int", low=3, high=4, default=3, ood_low=5, ood_high=6,
                     description="cards in the deck (3: J, Q, K)"),
    ])

    def __init__(self) -> None:
        self.tools: list = []
        self._task: Task | None = None
        self._history: list[str] = []
        self._over = False

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        return sample_tasks(generate, cls.context_space, split, n, seed, heldout_fraction=cls.heldout_fraction,
                            id_prefix=cls.name)

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        """The task's scripted line, one action per turn in play order."""
        return list(_task_data(task)["line"])

    @classmethod
    def gold_rewards(cls, task: Task) -> dict[str, float]:
        data = _task_data(task)
        return dict(zip(ROLES, payoff(data["cards"], data["line"])))

    @classmethod
    def opponents(cls) -> dict[str, Any]:
        return dict(OPPONENTS)

    def reset(self, task: Task, *, seed: int | None = None) -> dict[str, list[Message]]:
        data = _task_data(task)
        self._task, self._history, self._over = task, [], False
        deck = task.context.get("deck", max(data["cards"]))
        openings = {}
        for i, seat in enumerate(ROLES):
            text = f"Your card: {data['cards'][i]}."
            if i == 0:
                text += " You act first: check or bet?"
            openings[seat] = [Message("system", self.system_prompt.format(seat=seat, deck=deck)),
                              Message("user", text)]
        return openings

    def to_act(self) -> str:
        self._check_live()
        return ROLES[len(self._history) % 2]

    def view(self, seat: str) -> dict[str, Any]:
        self._check_live()
        index = ROLES.index(seat)
        return {"seat": seat, "card": self._task.data["cards"][index], "deck": self._task.context.get("deck", 3),
                "history": list(self._history), "legal": list(legal_actions(self._history))}

    async def step(self, message: Message) -> TableStep:
        self._check_live()
        seat = self.to_act()
        other = ROLES[1 - ROLES.index(seat)]
        legal = legal_actions(self._history)
        words = re.findall(r"[a-z]+", message.content.lower())
        action = words[0] if words else ""
        if action not in legal:
            self._over = True
            note = Message("user", f"{seat} made an invalid move ({message.content.strip()[:40]!r}); hand over.")
            return TableStep(messages={seat: [note], other: [note]}, rewards={seat: INVALID_PENALTY, other: 0.0},
                             terminated=True, info={"answered": False, "invalid": True},
                             outcome={seat: False, other: False})
        self._history.append(action)
        if legal_actions(self._history):
            moves = " or ".join(legal_actions(self._history))
            return TableStep(messages={other: [Message("user", f"{seat} {action}s. Your move: {moves}?")]},
                             info={"answered": True})
        self._over = True
        chips = payoff(self._task.data["cards"], self._history)
        cards = self._task.data["cards"]
        end = Message("user", f"{seat} {action}s. Cards: player_0 {cards[0]}, player_1 {cards[1]}. "
                              f"player_0 {chips[0]:+g}, player_1 {chips[1]:+g}.")
        return TableStep(messages={s: [end] for s in ROLES}, rewards=dict(zip(ROLES, chips)), terminated=True,
                         info={"answered": True}, outcome={s: c > 0 for s, c in zip(ROLES, chips)})

    def close(self) -> None:
        pass

    def _check_live(self) -> None:
        if self._task is None:
            raise EnvError("kuhn_poker: reset(task) first; the hand has not started")
        if self._over:
            raise EnvError("kuhn_poker: the hand is over; call reset(task) to deal another")


def _task_data(task: Task) -> dict[str, Any]:
    data = task.data
    if not isinstance(data.get("cards"), list) or tuple(data.get("line", ())) not in LINES:
        raise EnvError(f"task {task.id} lacks data['cards'] and a legal data['line']; draw kuhn_poker tasks with "
                       "sample_tasks")
    return data
