"""Credit across the attempts of a trial: cross-episode returns, trial-group advantages, reflections.

A *trial* is up to ``K`` attempts at one task; a *group* is the ``G`` trials of the same task
sampled in one step (the meta analogue of GRPO's group of episodes). Every function here works
on one group of plain floats: ``trial_rewards[i][k]`` is the reward of attempt ``k`` (0-based)
of trial ``i``, the attempt's own outcome (``Episode.reward`` of that attempt). The outputs are
one advantage per attempt, to be put on every sampled token of that attempt (and, through
``reflection_advantages``, of the reflections). Credit *within* an attempt (per turn) is not
done here; ``ctxrl.algo.turns`` does that for single episodes.

Two estimators, after two papers (ideas, not code, taken from them):

- ``cross_episode_advantages`` (LaMer: Jiang et al. 2025, "Meta-RL Induces Exploration in
  Language Agents"): the return of attempt ``k`` is its reward plus the ``gamma_trial``-discounted
  rewards of the later attempts of the same trial, ``G[i,k] = r[i,k] + gamma_trial * G[i,k+1]``;
  the advantage normalises ``G[i,k]`` over the trials of the group that played attempt ``k``
  (group statistics over *trials* at one attempt index, never over the attempts of one trial).
- ``relative_attempt_advantages`` (MR-Search: Xiao et al. 2026, "Meta-Reinforcement Learning with
  Self-Reflection for Agentic Search"): first centre each attempt's *reward* on the leave-one-out
  mean of the same attempt index in the other trials, then sum those relative rewards over the
  later attempts with ``gamma_trial``. Normalise-then-accumulate, where LaMer is
  accumulate-then-normalise; without early stops and with ``baseline="mean"`` the two agree with
  ``normalize="none"`` (tested).

Early stop. A trial stops at its first success (LaMer's protocol) or at the budget ``K``, so the
trials of a group have 1..K attempts. An attempt that was never played is *absent*: it earns
nothing after the trial ended, and it is left out of every group statistic (it has no tokens to
train). This is the ordinary episodic convention (no reward after termination) and it is exactly
LaMer's sum over the episodes a trial played. With 0/1 success rewards it gives
``G[i,0] = gamma_trial ** k*`` for a trial first solved at attempt ``k*`` (0 if never solved): with
``gamma_trial = 1`` the first attempt's return is "solved within K attempts" (success by attempt
K), and ``gamma_trial < 1`` also prefers solving sooner. The baseline of attempt index ``k`` is
taken over the trials that reached ``k``, which under early stop are the trials that failed
attempts ``0..k-1``: the right comparison set, since they all stand in the same situation.
The alternative convention, "a success keeps paying in the attempts it made unnecessary", is not
implemented (docs/meta.md says why). A trial cut short by an error (fewer than K attempts, last
one failed) breaks the convention and must be dropped before calling (``Trial.check`` says so).

Reflections. After attempt ``k`` (if the trial goes on) the policy writes a reflection that is
in the context of attempt ``k+1``; reflection ``k`` gets attempt ``k+1``'s advantage, see
``reflection_advantages`` for why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

NORMALIZE_MODES = ("std", "none")
BASELINES = ("loo", "mean")


def _check_gamma(gamma_trial: float) -> None:
    if not 0.0 <= gamma_trial <= 1.0:
        raise ValueError(f"gamma_trial must be in [0, 1], got {gamma_trial}; 1 sums later attempts' rewards "
                         "undiscounted, 0 keeps only each attempt's own reward")


def _check_group(trial_values: Sequence[Sequence[float]], num_attempts: int | None, what: str) -> int:
    """Validate a group; return K (``num_attempts`` or the longest trial)."""
    if num_attempts is not None and num_attempts < 1:
        raise ValueError(f"num_attempts must be >= 1, got {num_attempts}")
    for i, values in enumerate(trial_values):
        if len(values) == 0:
            raise ValueError(f"trial {i} has no attempts; drop trials whose first attempt errored "
                             "before computing credit")
        if num_attempts is not None and len(values) > num_attempts:
            raise ValueError(f"trial {i} has {len(values)} {what} but the budget is num_attempts={num_attempts}; "
                             "pass the K the trials were played with")
        for k, value in enumerate(values):
            if not math.isfinite(value):
                raise ValueError(f"trial {i} attempt {k} has a non-finite {what[:-1]} {value}; drop errored attempts "
                                 "(and their trials) before computing credit")
    longest = max((len(v) for v in trial_values), default=0)
    return num_attempts if num_attempts is not None else longest


def cross_episode_returns(rewards: Sequence[float], gamma_trial: float) -> list[float]:
    """Returns of the attempts of one trial: ``G[k] = r[k] + gamma_trial * G[k+1]``, ``G[K_i] = 0``.

    ``K_i = len(rewards)`` is the number of attempts the trial played; absent attempts (after an
    early stop) add nothing. E.g. rewards ``[0, 0, 1]``, ``gamma_trial = 0.5`` -> ``[0.25, 0.5, 1]``.
    """
    _check_gamma(gamma_trial)
    returns = [0.0] * len(rewards)
    running = 0.0
    for k in reversed(range(len(rewards))):
        running = float(rewards[k]) + gamma_trial * running
        returns[k] = running
    return returns


def trial_advantages(trial_returns: Sequence[Sequence[float]], *, normalize: str = "std", eps: float = 1e-6,
                     num_attempts: int | None = None) -> list[list[float]]:
    """Normalise the attempt returns of one group over its trials, per attempt index.

    With ``S_k`` the trials that played attempt ``k``:
    ``A[i,k] = (G[i,k] - mean_{j in S_k} G[j,k]) / (std_{j in S_k} G[j,k] + eps)``, the std
    Bessel-corrected as ``grpo_advantages`` (``normalize="none"`` only centres). An index
    reached by fewer than two trials has no baseline and its advantages are 0. With one attempt
    per trial this is ``grpo_advantages`` of the rewards; in general it is
    ``ctxrl.algo.turns.turn_advantages`` with attempts in the place of turns (both tested).

    trial_returns: G lists of 1..K floats  ->  the same ragged shape
    """
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
    k_max = _check_group(trial_returns, num_attempts, "returns")
    advantages = [[0.0] * len(values) for values in trial_returns]
    for k in range(k_max):
        members = [i for i, values in enumerate(trial_returns) if len(values) > k]
        if len(members) < 2:
            continue
        column = [float(trial_returns[i][k]) for i in members]
        mean = sum(column) / len(column)
        std = math.sqrt(sum((g - mean) ** 2 for g in column) / (len(column) - 1))
        for i, g in zip(members, column):
            advantages[i][k] = (g - mean) / (std + eps) if normalize == "std" else g - mean
    return advantages


def cross_episode_advantages(trial_rewards: Sequence[Sequence[float]], *, gamma_trial: float, normalize: str = "std",
                             eps: float = 1e-6, num_attempts: int | None = None) -> list[list[float]]:
    """LaMer-style advantages: ``trial_advantages`` of each trial's ``cross_episode_returns``."""
    _check_group(trial_rewards, num_attempts, "rewards")
    returns = [cross_episode_returns(rewards, gamma_trial) for rewards in trial_rewards]
    return trial_advantages(returns, normalize=normalize, eps=eps, num_attempts=num_attempts)


def relative_attempt_advantages(trial_rewards: Sequence[Sequence[float]], *, gamma_trial: float,
                                baseline: str = "loo", num_attempts: int | None = None) -> list[list[float]]:
    """MR-Search-style attempt-level relative advantages: centre each reward, then discount-sum.

    With ``S_k`` the trials that played attempt ``k`` and ``|S_k| >= 2``:

    - ``baseline="loo"`` (MR-Search): ``b[i,k] = mean_{j in S_k, j != i} r[j,k]``;
      ``baseline="mean"``: ``b[i,k] = mean_{j in S_k} r[j,k]``;
    - relative reward ``D[i,k] = r[i,k] - b[i,k]`` (0 where ``|S_k| < 2``: no baseline);
    - ``A[i,k] = D[i,k] + gamma_trial * A[i,k+1]`` over the attempts trial ``i`` played.

    Not divided by a std (MR-Search's choice; a leave-one-out std is noisy at small G). Unlike
    ``cross_episode_advantages``, each later attempt is compared with the trials that *reached
    that attempt*, so under early stops a trial is not blamed for the later attempts of others.

    trial_rewards: G lists of 1..K floats  ->  the same ragged shape
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    _check_gamma(gamma_trial)
    k_max = _check_group(trial_rewards, num_attempts, "rewards")
    relative = [[0.0] * len(values) for values in trial_rewards]
    for k in range(k_max):
        members = [i for i, values in enumerate(trial_rewards) if len(values) > k]
        n = len(members)
        if n < 2:
            continue
        total = sum(float(trial_rewards[i][k]) for i in members)
        for i in members:
            r = float(trial_rewards[i][k])
            relative[i][k] = r - ((total - r) / (n - 1) if baseline == "loo" else total / n)
    return [cross_episode_returns(values, gamma_trial) for values in relative]


def reflection_advantages(attempt_advantages: Sequence[float], num_reflections: int) -> list[float]:
    """Advantages of one trial's reflections: reflection ``k`` (written after attempt ``k``) gets ``A[k+1]``.

    The reflection written after attempt ``k`` is sampled once attempt ``k``'s reward is already
    fixed, and it sits in the context of attempt ``k+1``. It can change only what comes after it,
    and everything after it is exactly what ``G[k+1] = r[k+1] + gamma_trial * G[k+2]`` counts; no
    reward falls between the reflection and the next attempt. So the reflection is treated as the
    first action of attempt ``k+1`` (its "precedes" is *the attempt it conditions*) and shares
    that attempt's advantage, compared with the other trials that also reached attempt ``k+1``
    (exactly the trials that also wrote a reflection ``k``). Giving it ``A[k]`` instead would
    push down a good reflection only because the attempt it analyses failed: a signal it cannot
    have caused.

    A reflection with no next attempt (written after the last attempt the trial played) conditions
    nothing and gets 0; better still, the rollout should not sample it, or mask it out of the loss.

    attempt_advantages: [K_i] floats; num_reflections: K_i - 1 or K_i  ->  [num_reflections]
    """
    played = len(attempt_advantages)
    if not 0 <= num_reflections <= played:
        raise ValueError(f"{num_reflections} reflections for {played} attempts: a trial writes at most one "
                         "reflection after each attempt it played")
    return [float(attempt_advantages[k + 1]) if k + 1 < played else 0.0 for k in range(num_reflections)]
