"""Training on trials: credit across attempts, turned into per-token advantages (``algo.advantage = "meta"``).

A trial (``ctxrl.rollout.meta``) is one ``Episode`` whose sequences are its attempts; its
``info["attempts"]`` holds each attempt's own reward and where the reflection written after it
starts. This file does three things, in order:

1. ``attempt_advantages``: group the trials by task (``group_id``; the ``G`` trials of one task
   sampled in one step) and call ``ctxrl.meta.credit`` on each group's per-attempt rewards:
   ``cross_episode_advantages`` (LaMer) or ``relative_attempt_advantages`` (MR-Search). Group
   statistics are over *trials* at one attempt index, never over the attempts of one trial. A plain
   episode (no ``info["attempts"]``) counts as a one-attempt trial, so with ``num_attempts = 1``
   ``cross_episode`` / ``std`` is GRPO and ``relative`` / ``loo`` is RLOO.
2. ``reflection_advantages``: the reflection written after attempt ``k`` gets attempt ``k+1``'s
   advantage (the attempt it conditions; docs/meta.md says why).
3. ``expand_trials``: one training sequence per attempt; a sampled token before the attempt's
   ``reflection_start`` carries the attempt's advantage, one from it on carries the reflection's.
   Context tokens (mask 0) carry 0. With ``token-mean`` aggregation (required) every sampled token
   weighs the same however a trial is cut into attempts.

Errored trials must be dropped before (they break the "stop early only on success" convention the
credit relies on; ``Trial.check``). Everything here is plain Python over the episodes' lists: no
hidden state, no config object.
"""

from __future__ import annotations

import dataclasses

from ctxrl.meta.credit import cross_episode_advantages, reflection_advantages, relative_attempt_advantages
from ctxrl.types import Episode

CREDITS = ("cross_episode", "relative")


def attempt_rewards(trial: Episode) -> list[float]:
    """Each attempt's own (environment) reward; a plain episode is one attempt."""
    records = trial.info.get("attempts")
    return [trial.reward] if records is None else [float(r["reward"]) for r in records]


def attempt_advantages(trials: list[Episode], *, credit: str, gamma_trial: float, normalize: str = "std",
                       baseline: str = "loo", num_attempts: int | None = None) -> list[list[float]]:
    """One advantage per attempt of each trial, with group statistics over the trials of each task.

    trials: N episodes (``group_id`` = task)  ->  N lists of 1..K floats (attempt ``k`` of trial ``i``)
    """
    if credit not in CREDITS:
        raise ValueError(f"credit must be one of {', '.join(CREDITS)}, not {credit!r}")
    groups: dict[int, list[int]] = {}
    for i, trial in enumerate(trials):
        groups.setdefault(trial.group_id, []).append(i)
    out: list[list[float]] = [[] for _ in trials]
    for members in groups.values():
        rewards = [attempt_rewards(trials[i]) for i in members]
        if credit == "cross_episode":
            values = cross_episode_advantages(rewards, gamma_trial=gamma_trial, normalize=normalize,
                                              num_attempts=num_attempts)
        else:
            values = relative_attempt_advantages(rewards, gamma_trial=gamma_trial, baseline=baseline,
                                                 num_attempts=num_attempts)
        for i, advantages in zip(members, values):
            out[i] = advantages
    return out


def expand_trials(trials: list[Episode], advantages: list[list[float]]) -> tuple[list[Episode], list[list[float]]]:
    """One training sequence per attempt, with per-token advantages (attempt, then reflection).

    Returns (sequences as unsegmented episodes, one advantage list per sequence aligned with its
    ``input_ids``). Sequences without sampled tokens are not trained.
    """
    out_eps: list[Episode] = []
    out_adv: list[list[float]] = []
    for trial, attempt_adv in zip(trials, advantages, strict=True):
        records = trial.info.get("attempts")
        sequences = trial.sequences() if trial.segments else [None]
        if records is None:  # a plain episode: one attempt, whatever its sequences
            starts = [None] * len(sequences)
            attempt_adv = attempt_adv * len(sequences)
            reflection_adv = [0.0] * len(sequences)
        else:
            if len(sequences) != len(records) or len(attempt_adv) != len(records):
                raise ValueError(f"trial of task {trial.task.id} has {len(sequences)} sequences, {len(records)} "
                                 f"attempt records and {len(attempt_adv)} advantages; they must agree (one per attempt)")
            starts = [r["reflection_start"] for r in records]
            reflection_adv = reflection_advantages(attempt_adv, len(records))
        for seq, a, r, start in zip(sequences, attempt_adv, reflection_adv, starts):
            episode = trial if seq is None else dataclasses.replace(
                trial, input_ids=seq.input_ids, loss_mask=seq.loss_mask, behavior_logprobs=seq.behavior_logprobs,
                turn_index=seq.turn_index, messages=seq.messages, segments=[])
            if not any(episode.loss_mask):
                continue  # nothing sampled in it: nothing to train
            cut = len(episode.loss_mask) if start is None else start
            out_eps.append(episode)
            out_adv.append([(a if i < cut else r) * m for i, m in enumerate(episode.loss_mask)])
    return out_eps, out_adv


def trial_token_advantages(trials: list[Episode], *, credit: str, gamma_trial: float, normalize: str = "std",
                           baseline: str = "loo",
                           num_attempts: int | None = None) -> tuple[list[Episode], list[list[float]]]:
    """``attempt_advantages`` then ``expand_trials``: what the RL step trains on."""
    values = attempt_advantages(trials, credit=credit, gamma_trial=gamma_trial, normalize=normalize,
                                baseline=baseline, num_attempts=num_attempts)
    return expand_trials(trials, values)
