"""Evaluation of a multi-role environment: the learner against fixed opponents, win rates with intervals, Elo.

``evaluate_matches(worker, split, n_tasks, seed=, opponents=)`` plays ``n_tasks`` tasks of ``split`` against
each opponent (``scripted:NAME``, ``frozen:PATH``; ``roles.eval_opponents``): once with the learner in each role
whose other roles the opponent can play (``ctxrl.envs.roles.playable``), the same tasks and seed every time, so
two checkpoints meet the same deals. The learner's seats are those its trained policies played. Its summary:

- ``success``, ``reward``, ... (``summarize``): the learner's seats over every opponent together;
- per opponent ``X``: ``win_rate_vs_X`` (its seats' success), ``win_low_vs_X`` / ``win_high_vs_X`` (the 95 %
  Wilson interval), ``reward_vs_X`` and ``seats_vs_X`` (how many seats the rate is over);
- per role ``R``: ``success_R``, ``reward_R``.

Without opponents the evaluation plays self-play matches and summarises every trained seat the same way.

``wilson_interval`` and ``elo_ratings`` are pure functions. ``elo_ratings`` fits Bradley–Terry strengths to
game results by minorisation-maximisation (Hunter 2004) and writes them on the Elo scale (400 points per
factor of 10 in the odds of winning, mean 1000); ``prior`` virtual drawn games per pair that met keep an
unbeaten player's rating finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ctxrl.rollout.summary import summarize
from ctxrl.types import Episode

Z95 = 1.959963984540054


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a success rate (95 % by default); ``(0, 1)`` for no trials."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"{successes} successes in {n} trials")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def elo_ratings(games: list[tuple[str, str, float]], *, prior: float = 0.0, mean: float = 1000.0,
                tolerance: float = 1e-10, max_iterations: int = 100_000) -> dict[str, float]:
    """Elo-scale ratings from ``(a, b, score of a)`` games (1 a won, 0.5 a draw, 0 b won).

    ``prior``: drawn virtual games added to every pair that played (0: the plain maximum-likelihood fit, infinite
    for a player that never lost). Players with no game against the others keep the mean.
    """
    players = sorted({p for a, b, _ in games for p in (a, b)})
    wins = {p: 0.0 for p in players}
    meetings: dict[tuple[str, str], float] = {}
    for a, b, score in games:
        if a == b or not 0.0 <= score <= 1.0:
            raise ValueError(f"game {a!r} v {b!r} scored {score}: players must differ and scores lie in [0, 1]")
        wins[a] += score
        wins[b] += 1.0 - score
        key = (min(a, b), max(a, b))
        meetings[key] = meetings.get(key, 0.0) + 1.0
    for key in meetings:
        meetings[key] += prior
        for p in key:
            wins[p] += prior / 2
    strength = {p: 1.0 for p in players}
    for _ in range(max_iterations):
        new = {}
        for p in players:
            denominator = sum(n / (strength[a] + strength[b]) for (a, b), n in meetings.items() if p in (a, b))
            new[p] = wins[p] / denominator if denominator else strength[p]
        scale = math.exp(sum(math.log(max(v, 1e-300)) for v in new.values()) / len(new))
        new = {p: v / scale for p, v in new.items()}
        done = max(abs(math.log(max(new[p], 1e-300)) - math.log(max(strength[p], 1e-300))) for p in players) < tolerance
        strength = new
        if done:
            break
    return {p: mean + 400.0 * math.log10(max(strength[p], 1e-300)) for p in players}


def learner_seats(episodes: list[Episode]) -> list[Episode]:
    """The learner's seats: those its trained policies played (the shared one, a role's own), not the pinned ones."""
    return [e for e in episodes if e.info.get("trains", True)]


def seat_summary(episodes: list[Episode]) -> dict[str, float]:
    """``summarize`` of the seats, and each role's success and reward."""
    return {**summarize(episodes), **role_figures(episodes)}


def role_figures(episodes: list[Episode]) -> dict[str, float]:
    """Each role's success and reward over the seats that play it (``success_ROLE``, ``reward_ROLE``); nothing for
    single-agent episodes (role "")."""
    out: dict[str, float] = {}
    for role in sorted({e.role for e in episodes if e.role}):
        mine = [e for e in episodes if e.role == role]
        out[f"success_{role}"] = sum(e.success for e in mine) / len(mine)
        out[f"reward_{role}"] = sum(e.reward for e in mine) / len(mine)
    return out


def opponent_name(policy: str) -> str:
    """A metric-name-safe name of an opponent: ``scripted:nash`` -> ``nash``, ``frozen:runs/a/step-3`` -> ``step-3``."""
    kind, _, argument = policy.partition(":")
    name = argument.rstrip("/").rsplit("/", 1)[-1] if kind == "frozen" else argument
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def evaluate_matches(worker, split: str, n_tasks: int, *, seed: int, opponents: tuple[str, ...] = (),
                     on_episode: Callable[[int, int], None] | None = None) -> tuple[dict[str, float], list[Episode]]:
    """Play ``split``'s tasks against every opponent, the learner in each role it can take (see the module
    docstring); the summary and every episode (all seats)."""
    from ctxrl.rollout.spec import RolloutRequest

    tasks = worker.env_cls.sample_tasks(split, n_tasks, seed)
    if not opponents:
        episodes = worker.run(RolloutRequest(tasks=tasks, seed=seed, phase="eval"), on_episode=on_episode)
        return seat_summary(learner_seats(episodes)), episodes
    everything, mine, out = [], [], {}
    for opponent in opponents:
        played = []
        for pins in seatings(worker, opponent):
            played += worker.run(RolloutRequest(tasks=tasks, seed=seed, phase="eval", policies=pins),
                                 on_episode=on_episode)
        seats = learner_seats(played)
        name, wins = opponent_name(opponent), sum(e.success for e in seats)
        low, high = wilson_interval(wins, len(seats))
        out.update({f"win_rate_vs_{name}": wins / max(len(seats), 1), f"win_low_vs_{name}": low,
                    f"win_high_vs_{name}": high, f"seats_vs_{name}": float(len(seats)),
                    f"reward_vs_{name}": sum(e.reward for e in seats) / max(len(seats), 1)})
        everything += played
        mine += seats
    return {**seat_summary(mine), **out}, everything


def seatings(worker, opponent: str) -> list[dict[str, str]]:
    """The requests' ``policies`` that seat the learner in each role, ``opponent`` in every other role; a role is
    skipped where the opponent cannot play the others (a scripted proposer cannot solve)."""
    from ctxrl.envs.roles import opponents_of, playable, roles_of

    roles = roles_of(worker.env_cls)
    kind, _, name = opponent.partition(":")
    policy: Any = opponents_of(worker.env_cls).get(name) if kind == "scripted" else None
    out = []
    for learner in roles:
        others = [r for r in roles if r != learner]
        if all(policy is None or playable(policy, r) for r in others):
            out.append({r: opponent for r in others})
    if not out:
        raise ValueError(f"opponent {opponent} cannot play any seating of {', '.join(roles)}")
    return out
