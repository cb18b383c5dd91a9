"""Phase 1 with partial rollouts (``rollout.partial_step_tokens``): the step's new groups, the pool played, its figures.

The worker's pool (``ctxrl.rollout.partial``) holds the episodes carried over from earlier steps; a step starts
``tasks_per_step`` minus the groups in flight new ones, drawn and seeded as round 0 of the step is without partial
rollouts (with nothing in flight, the very tasks and seeds), their group ids offset by ``step * tasks_per_step`` so
that no two groups of the pool share one. It trains the groups that finished, whenever they started, their rewards
shaped as a waiting step shapes its episodes.

Figures (the step's row): ``staleness_mean`` / ``staleness_max`` per trained episode, now versions behind the
learner's at its oldest token, as bounded staleness logs them; ``token_staleness_mean`` / ``token_staleness_max`` per
sampled token; ``partial_started`` (new episodes), ``partial_carried_in`` (episodes in flight when the step began),
``partial_carried_trained`` (trained episodes an earlier step started), ``partial_in_flight`` and
``partial_groups_in_flight`` (left in flight at the step's end: what a checkpoint written after this step does not
keep), ``partial_rounds``.

Resume: a checkpoint keeps no episode in flight (a live environment cannot be saved). A resumed run's first step
finds the pool empty, says so once, and starts ``tasks_per_step`` fresh groups; the episodes dropped are that
checkpoint step's ``partial_in_flight``. A resumed run is therefore not the run that went on.
"""

from __future__ import annotations

import logging
from typing import Any

from ctxrl.rollout.partial import PartialStep
from ctxrl.rollout.spec import RolloutRequest
from ctxrl.run.rewards import shape_rewards
from ctxrl.types import Episode, turn_versions

log = logging.getLogger(__name__)


def partial_round(collector, step: int) -> tuple[list[Episode], dict[str, Any]]:
    """Step ``step``'s episodes with partial rollouts, from ``collector`` (a ``ctxrl.run.collect.Collector``): the
    groups that finished in it, rewards shaped, and its figures."""
    c, worker = collector.config, collector.worker
    if worker.partial is None and step > 0:
        log.warning("partial rollouts: step %d starts with no episode in flight; a checkpoint keeps none, so the ones "
                    "in flight when it was written were dropped (partial_in_flight in the metrics row of step %d)",
                    step + 1, step)
    n, g = c.rollout.tasks_per_step, c.rollout.group_size
    fresh = n - (worker.partial.groups_in_flight if worker.partial is not None else 0)
    tasks = collector.curriculum.sample_tasks(collector.env_cls, fresh, collector.seeds.tasks(step, 0), step) \
        if fresh > 0 else []
    request = RolloutRequest(tasks=tasks, group_size=g, seed=collector.seeds.rollout(step, 0), phase="train",
                             step=step, group_offset=step * n,
                             max_turns=collector.curriculum.max_turns(step, c.env.max_turns),
                             context_budget=collector.context_budget(step))
    played = worker.play_partial(request, c.rollout.partial_step_tokens)
    shape_rewards(played.episodes, c.reward, max_total_tokens=c.rollout.max_total_tokens,
                  judge=c.settings_of("reward", "judge"))
    return played.episodes, {**staleness_figures(played.episodes, worker.policy_version), **pool_figures(played)}


def staleness_figures(episodes: list[Episode], current: int) -> dict[str, float]:
    """How many versions behind ``current`` (the learner's) the sampled tokens of the episodes that train are: per
    episode at its oldest token, and per token. Errored episodes and seats that do not train are left out."""
    per_episode, per_token = [], []
    for e in episodes:
        if e.truncation == "error" or e.info.get("trains", True) is False:
            continue
        versions = turn_versions(e)
        if versions:
            per_token += [current - v for v in versions]
            per_episode.append(current - min(versions))
    return {"staleness_mean": _mean(per_episode), "staleness_max": float(max(per_episode, default=0)),
            "token_staleness_mean": _mean(per_token), "token_staleness_max": float(max(per_token, default=0))}


def pool_figures(played: PartialStep) -> dict[str, float]:
    """The pool's counts for the step's row (the module docstring)."""
    return {"partial_started": float(played.started), "partial_carried_in": float(played.carried_in),
            "partial_carried_trained": float(played.carried_trained), "partial_in_flight": float(played.in_flight),
            "partial_groups_in_flight": float(played.groups_in_flight), "partial_rounds": float(played.rounds)}


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0
