"""Warm-start demonstrations of a trial: a failed attempt, a written reflection, then the solution.

A model warm-started on single solved episodes has never seen a reflection request or a note
from an earlier attempt. Asked to reflect, a small one writes another tool call; shown its notes,
it drifts into invalid calls (docs/experiments/meta.md measures both). Trial demos show it what a
trial looks like, played through the real meta loop (``run_trial``) with a ``ScriptedEngine``:

- attempt 1 plays the environment's ``failure(task)`` script (a mine revealed; the bandit's arms
  pulled in turn, exploring) and fails;
- asked to reflect, the engine answers with ``reflection(task, messages)``, written from that
  attempt's conversation (what went wrong, what to do instead);
- attempt 2 opens with the note (``meta.carry``) and plays ``solve(task)``, or, where the
  environment has a ``solve_after(task, reflection)`` hook, what the reflection says to do (the
  bandit pulls the arm its note names): then the note matters, and a trial whose note was wrong
  (attempt 2 fails) is dropped rather than trained.

Only the reflection and attempt 2 train (mask 1): attempt 1's turns are set to mask 0 after the
play, so the warm start never learns the mistake. Environments opt in with both hooks
(``minesweeper`` and ``bandit`` have them); asking for trial demos of one without is an error.
"""

from __future__ import annotations

import asyncio
import dataclasses

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.hooks import has_trial_hooks, hook
from ctxrl.envs.recorded import RecordedEnv
from ctxrl.meta.rollout import run_trial
from ctxrl.rollout.recorder import untrain
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.sections import MetaConfig
from ctxrl.types import Episode


def mask_failed_attempt(trial: Episode) -> Episode:
    """Set every sampled token of the failed first attempt to mask 0, keeping its reflection (mask 1)."""
    start = trial.info["attempts"][0]["reflection_start"]
    if not trial.segments or start is None:
        raise ValueError(f"trial demo of task {trial.task.id} has no reflection after its first attempt")
    untrain(trial, 0, start)
    return trial


def _play(env_cls, task, renderer: ChatRenderer, limits: RolloutLimits, policy: MetaConfig, seed: int):
    """One scripted trial of ``task``: ``failure``, the reflection, then ``solve_after(reflection)`` or ``solve``."""
    played: list[RecordedEnv] = []
    follow = hook(env_cls, "solve_after")

    def make_env():
        played.append(RecordedEnv(env_cls()))
        return played[-1]

    def reflect() -> str:
        text = hook(env_cls, "reflection")(task, played[-1].messages)
        if follow is not None:
            engine.extend(follow(task, text))
        return text

    engine = ScriptedEngine([*hook(env_cls, "failure")(task), *([] if follow else env_cls.solve(task))], renderer,
                            reflection=reflect)
    return run_trial(make_env, task, engine, renderer, limits, policy, seed=seed)


def _outcomes(trial: Episode) -> list[tuple[bool, str | None]]:
    return [(r["success"], r["truncation"]) for r in trial.info["attempts"]]


async def build_trial_demos(env_cls, renderer: ChatRenderer, n: int, policy: MetaConfig, *, seed: int = 0,
                            limits: RolloutLimits | None = None) -> list[Episode]:
    """Play ``n`` scripted two-attempt trials on training tasks (see the module docstring); raises with the
    reason if the environment lacks the hooks or a script does not play as one failure then a success.

    With a ``solve_after(task, reflection)`` hook the second attempt follows the reflection, and can fail
    (the bandit's most-paying arm in a few pulls is not always the best), as the first attempt's exploring
    can succeed: such trials are dropped and more tasks drawn, up to 8 rounds."""
    name = getattr(env_cls, "name", env_cls.__name__)
    if not has_trial_hooks(env_cls):
        raise ValueError(f"environment {name!r} has no failure(task) and reflection(task, messages) hooks, so it "
                         "cannot script trial demos; give it both (docs/meta.md) or set sft.trial_demos = 0")
    if policy.num_attempts < 2 or not policy.reflect:
        raise ValueError("trial demos need at least 2 attempts with reflection (meta.num_attempts or "
                         "meta.eval_attempts >= 2, meta.reflect = true)")
    limits = limits or RolloutLimits(max_turns=16, max_new_tokens=4096, max_total_tokens=1 << 20)
    policy = dataclasses.replace(policy, stop_on_success=True)
    follows = hook(env_cls, "solve_after") is not None
    kept: list[Episode] = []
    for round_ in range(8 if follows else 1):
        tasks = env_cls.sample_tasks("train", n if round_ == 0 else 2 * (n - len(kept)), seed + 7919 * round_)
        trials = list(await asyncio.gather(*(_play(env_cls, t, renderer, limits, policy, seed) for t in tasks)))
        for trial in trials:
            if trial.truncation == "error" or _outcomes(trial) != [(False, None), (True, None)]:
                if follows and trial.truncation != "error":
                    continue  # exploring happened to succeed, or the followed note was wrong: not a demo of either
                raise RuntimeError(f"trial demo of task {trial.task.id} did not play as a failure then a solution "
                                   f"(attempts: {_outcomes(trial)}, error: {trial.info.get('error')}); check the "
                                   "env's failure() and solve() and the rollout limits")
            if trial.info["attempts"][0].get("reflection_truncated"):
                raise RuntimeError(f"the scripted reflection of task {trial.task.id} is longer than "
                                   f"meta.reflection_max_tokens={policy.reflection_max_tokens}; raise it so that demos "
                                   "show whole reflections")
            kept.append(mask_failed_attempt(trial))
        if len(kept) >= n:
            return kept[:n]
    raise RuntimeError(f"only {len(kept)} of {n} trial demos of {name!r} were solved by following their reflection "
                       "after 8 rounds of tasks; check the env's solve_after()")
