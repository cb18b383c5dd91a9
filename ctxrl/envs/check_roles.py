"""The conformance checks of a multi-role environment (``ctxrl.envs.roles``), run by ``check_env``.

``check_env`` (``ctxrl.envs.check``) checks what every environment shares (seeded sampling, splits, tool
schemas, close twice) and hands a multi-role environment to ``table_problems`` for the rest:

- ``roles`` is a non-empty tuple of distinct names without ``/``, and the ``gold_rewards`` hook exists;
- ``reset`` returns every seat's opening as a dict seat -> messages, seats every role and only its roles, and
  is deterministic for a task and seed;
- playing ``solve(task)``'s turns in order, each to the seat ``to_act()`` names, ends the match with each
  seat's total reward equal to ``gold_rewards(task)`` (and summing to 0 when the environment says ``zero_sum``);
- ``to_act`` or ``step`` after the end raises ``EnvError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ctxrl.envs.base import EnvError
from ctxrl.envs.hooks import flag, hook
from ctxrl.envs.roles import SEAT_SEPARATOR, seat_role
from ctxrl.types import Message, TableStep, Task

Parse = Callable[[str], Message]


def table_problems(env_cls: type, tasks: dict[str, list[Task]], seed: int) -> list[str]:
    """The problems of the multi-role environment ``env_cls``'s declarations and ``reset`` (the gold play is
    ``gold_problems``, awaited once these are none)."""
    roles = getattr(env_cls, "roles", ())
    if not isinstance(roles, tuple) or not roles or len(set(roles)) != len(roles) or not all(
            isinstance(r, str) and r and SEAT_SEPARATOR not in r for r in roles):
        return [f"{env_cls.__name__}.roles must be a tuple of distinct role names without {SEAT_SEPARATOR!r}, "
                f"got {roles!r}"]
    if hook(env_cls, "gold_rewards") is None:
        return [f"{env_cls.__name__} declares roles but no gold_rewards(task) -> dict[seat, reward]: check-env "
                "needs each seat's reward when solve(task) is played"]
    problems: list[str] = []
    if tasks:
        _check_reset(env_cls, next(iter(tasks.values()))[0], seed, problems)
    return problems


async def gold_problems(env_cls: type, tasks: dict[str, list[Task]], seed: int, parse: Parse) -> list[str]:
    """The gold play of one task per split that goes wrong, if any (see the module docstring)."""
    problems = []
    for split, split_tasks in tasks.items():
        for task in split_tasks:
            problem = await _replay_gold(env_cls, task, seed, parse)
            if problem:
                problems.append(f"gold play on {split} task {task.id} ({task.prompt!r}): {problem}")
                break  # one example per split is enough to act on
    return problems


def _check_reset(env_cls: type, task: Task, seed: int, problems: list[str]) -> None:
    results = []
    for _ in range(2):
        env = env_cls()
        try:
            openings = env.reset(task, seed=seed)
        except Exception as exc:  # noqa: BLE001 - report, don't crash the checker
            problems.append(f"reset(task {task.id}) raised {type(exc).__name__}: {exc}")
            return
        finally:
            env.close()
        problem = opening_problem(env_cls, openings)
        if problem:
            problems.append(problem)
            return
        results.append({seat: [m.to_dict() for m in messages] for seat, messages in openings.items()})
    if results[0] != results[1]:
        problems.append(f"reset(task {task.id}, seed={seed}) is not deterministic: two fresh environments "
                        "returned different openings; derive any randomness from the task and seed")


def opening_problem(env_cls: type, openings: Any) -> str | None:
    """What is wrong with what a multi-role ``reset`` returned, or None."""
    if not isinstance(openings, dict) or not openings or not all(
            isinstance(m, list) and all(isinstance(x, Message) for x in m) for m in openings.values()):
        return "reset() of a multi-role environment must return a dict seat -> list of ctxrl.types.Message"
    seated = {seat_role(seat) for seat in openings}
    if seated != set(env_cls.roles):
        return (f"reset() seats the roles {sorted(seated)}, but the environment declares {list(env_cls.roles)}; "
                f"seat every role (a seat is named ROLE or ROLE{SEAT_SEPARATOR}K)")
    return None


async def _replay_gold(env_cls: type, task: Task, seed: int, parse: Parse) -> str | None:
    try:
        texts, gold = env_cls.solve(task), env_cls.gold_rewards(task)
    except Exception as exc:  # noqa: BLE001
        return f"solve() or gold_rewards() raised {type(exc).__name__}: {exc}"
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        return "solve() must return a non-empty list of turns, in the order the seats act"
    env = env_cls()
    try:
        openings = env.reset(task, seed=seed)
        totals = {seat: 0.0 for seat in openings}
        result = None
        for i, text in enumerate(texts):
            if result is not None and result.terminated:
                return f"the match ended after turn {i} but solve() returned {len(texts)} turns"
            seat = env.to_act()
            if seat not in totals:
                return f"to_act() named {seat!r}, not one of the seats reset() returned ({', '.join(totals)})"
            result = await env.step(parse(text))
            if not isinstance(result, TableStep):
                return f"step() must return a ctxrl.types.TableStep, got {type(result).__name__}"
            strangers = sorted((set(result.rewards) | set(result.messages) | set(result.outcome)) - set(totals))
            if strangers:
                return f"step() on turn {i} addressed {strangers}, which are not seats"
            for name, reward in result.rewards.items():
                totals[name] += reward
        return await _end_problem(env, env_cls, result, totals, gold)
    finally:
        env.close()


async def _end_problem(env: Any, env_cls: type, result: TableStep | None, totals: dict[str, float],
                 gold: dict[str, float]) -> str | None:
    if result is None or not result.terminated:
        return "the match did not end after the last gold turn; end it with terminated=True"
    expected = {seat: float(gold.get(seat, 0.0)) for seat in totals}
    if set(gold) - set(totals) or any(abs(totals[s] - expected[s]) > 1e-9 for s in totals):
        return (f"the seats' rewards {totals} differ from gold_rewards {gold}; check that step() scores the gold "
                "turns as gold_rewards says")
    if flag(env_cls, "zero_sum") and abs(sum(totals.values())) > 1e-9:
        return f"a zero_sum environment's rewards sum to {sum(totals.values())}, not 0"
    for what in ("to_act()", "step()"):
        try:
            if what == "to_act()":
                env.to_act()
            else:
                await env.step(Message("assistant", "x"))
        except EnvError:
            continue
        except Exception as exc:  # noqa: BLE001
            return f"{what} after the end raised {type(exc).__name__}, should raise ctxrl.envs.EnvError"
        return f"{what} after the end did not raise; raise ctxrl.envs.EnvError with a clear message"
    return None
