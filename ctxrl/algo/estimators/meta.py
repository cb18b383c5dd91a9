"""The ``meta`` estimator: credit across the attempts of a trial, turned into per-token advantages.

A trial (``ctxrl.meta.rollout``) is one ``Episode`` whose sequences are its attempts; its
``info["attempts"]`` holds each attempt's own reward and where the reflection written after it
starts. This file does three things, in order:

1. ``attempt_advantages``: group the trials by task (``group_id``; the ``G`` trials of one task
   sampled in one step) and call ``ctxrl.algo.credit`` on each group's per-attempt rewards:
   ``cross_episode_advantages`` (LaMer) or ``relative_attempt_advantages`` (MR-Search). Group
   statistics are over *trials* at one attempt index, never over the attempts of one trial. A plain
   episode (no ``info["attempts"]``) counts as a one-attempt trial, so with ``num_attempts = 1``
   ``cross_episode`` / ``std`` is GRPO and ``relative`` / ``loo`` is RLOO.
2. ``reflection_advantages``: the reflection written after attempt ``k`` gets attempt ``k+1``'s
   advantage (the attempt it conditions; docs/meta.md says why).
3. ``expand_trials``: one training row per attempt; a sampled token before the attempt's
   ``reflection_start`` carries the attempt's advantage, one from it on carries the reflection's.
   Context tokens (mask 0) carry 0. With ``token-mean`` aggregation (required) every sampled token
   weighs the same however a trial is cut into attempts.

Errored trials must be dropped before (they break the "stop early only on success" convention the
credit relies on; ``Trial.check``). Everything here is plain Python over the episodes' lists: no
hidden state, no config object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxrl.algo.credit import (
    BASELINES,
    NORMALIZE_MODES,
    cross_episode_advantages,
    reflection_advantages,
    relative_attempt_advantages,
)
from ctxrl.algo.estimators.base import Estimator, SegmentBonus, register_estimator
from ctxrl.settings import in_range
from ctxrl.types import Episode, TrainSequence

CREDITS = ("cross_episode", "relative")


@dataclass(frozen=True)
class MetaCreditSettings:
    """``[algo.meta]``: how the ``meta`` estimator credits the attempts of a trial (docs/meta.md)."""

    credit: str = "cross_episode"
    """``cross_episode`` (LaMer: discounted return over later attempts, normalised over the trials of a task)
    or ``relative`` (MR-Search: each attempt's reward centred on the other trials' same attempt, then summed)."""
    normalize: str = "std"
    """``cross_episode`` only: ``std`` divides by the group std (GRPO-like), ``none`` only centres."""
    baseline: str = "loo"
    """``relative`` only: ``loo`` (mean of the other trials) or ``mean`` (of all trials that played the attempt)."""
    gamma_trial: float = field(default=1.0, metadata=in_range(0.0, 1.0))
    """Discount across the attempts of a trial: 1 credits solving within K attempts at all, below 1 also
    prefers solving sooner, 0 makes attempts independent."""

    def __post_init__(self) -> None:
        for key, value, choices in (("credit", self.credit, CREDITS), ("normalize", self.normalize, NORMALIZE_MODES),
                                    ("baseline", self.baseline, BASELINES)):
            if value not in choices:
                raise ValueError(f"{key} must be one of {', '.join(choices)}; got {value!r}")


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


def expand_trials(trials: list[Episode], advantages: list[list[float]]) -> list[list[TrainSequence]]:
    """Per trial, one training row per attempt with per-token advantages (the attempt's, then its reflection's).

    Every row is aligned with its sequence's ``input_ids``; sequences without sampled tokens are
    not trained. A plain episode (no attempt records) is one attempt, whatever its sequences.
    """
    out: list[list[TrainSequence]] = []
    for trial, attempt_adv in zip(trials, advantages, strict=True):
        records = trial.info.get("attempts")
        sequences = trial.sequences() if trial.segments else [trial]
        if records is None:  # a plain episode: one attempt, whatever its sequences
            starts = [None] * len(sequences)
            attempt_adv = attempt_adv * len(sequences)
            reflection_adv = [0.0] * len(sequences)
        else:
            counts = [r.get("segments", 1) for r in records]  # (a history-rewriting template cuts attempts)
            if len(sequences) != sum(counts) or len(attempt_adv) != len(records):
                raise ValueError(f"trial of task {trial.task.id} has {len(sequences)} sequences, {len(records)} "
                                 f"attempt records ({sum(counts)} segments) and {len(attempt_adv)} advantages; they "
                                 "must agree (one per attempt; an attempt's segments in order)")
            per_attempt = reflection_advantages(attempt_adv, len(records))
            starts, reflection_adv, attempt_adv = [], [], [a for a, n in zip(attempt_adv, counts) for _ in range(n)]
            for record, n, r in zip(records, counts, per_attempt):  # the reflection is in an attempt's last segment
                starts += [None] * (n - 1) + [record["reflection_start"]]
                reflection_adv += [r] * n
        rows = []
        for seq, a, r, start in zip(sequences, attempt_adv, reflection_adv, starts):
            if not any(seq.loss_mask):
                continue  # nothing sampled in it: nothing to train
            cut = len(seq.loss_mask) if start is None else start
            rows.append(TrainSequence.of(seq, [(a if i < cut else r) * m for i, m in enumerate(seq.loss_mask)],
                                         group_id=trial.group_id, policy_version=trial.policy_version))
        out.append(rows)
    return out


@register_estimator
class Meta(Estimator):
    """Credit across attempts (``[algo.meta]``: ``ctxrl.algo.credit``), group statistics over the trials of a task;
    the trial budget is ``num_attempts`` (``meta.num_attempts``)."""

    name = "meta"
    credits_attempts = True
    Settings = MetaCreditSettings

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None,
                 segment_bonus: SegmentBonus | None = None) -> list[list[TrainSequence]]:
        if token_rewards is not None:
            raise ValueError("the meta estimator credits each attempt with its environment reward; per-token rewards "
                             "(algo.kl_placement=reward) are not supported with it")
        o = self.options
        values = attempt_advantages(episodes, credit=o.credit, gamma_trial=o.gamma_trial, normalize=o.normalize,
                                    baseline=o.baseline, num_attempts=self.num_attempts)
        return expand_trials(episodes, values)
