"""Learning across episodes (meta-RL) (docs/meta.md):

- ``rollout``: the meta loop, a trial of up to K attempts with feedback and reflections between them;
- ``runner``: the ``meta`` episode runner, which plays trials and annealed demonstrations for a rollout worker;
- ``demos`` and ``anneal``: few-shot demonstrations in training prompts, fading on a schedule;
- ``trial_demos``: warm-start demonstrations of a failed attempt, its reflection and the solution;
- ``trial``, ``stats`` and ``metrics``: what trials are measured by.

Credit across attempts (LaMer, MR-Search) and the ``meta`` advantage estimator are pure maths over the
trials' per-attempt rewards, so they live with the other estimators (``ctxrl.algo.credit``,
``ctxrl.algo.estimators.meta``), where ``algo.advantage = "meta"`` resolves wherever estimators are read;
the credit functions are re-exported here.

Importing the package loads the pure modules (``anneal``, ``stats``, ``trial``) and ``runner``, which
registers the ``meta`` runner with ``ctxrl.rollout.runners``: rollout code never imports this package, it
chooses the runner by name. The rest are imported where they are used.
"""

from ctxrl.algo.credit import (
                               cross_episode_advantages,
                               cross_episode_returns,
                               reflection_advantages,
                               relative_attempt_advantages,
                               trial_advantages,
)
from ctxrl.meta import runner  # noqa: F401 - registers the meta episode runner
from ctxrl.meta.anneal import DemoSchedule, demo_count, demo_probability, num_demos, sample_demos
from ctxrl.meta.stats import (
                               exploration_stats,
                               independent_pass_at_k,
                               meta_metrics,
                               pass_at_k,
                               success_at_attempt,
                               success_by_attempt,
                               trial_exploration,
)
from ctxrl.meta.trial import Attempt, Trial

__all__ = [
    "Attempt", "DemoSchedule", "Trial", "cross_episode_advantages", "cross_episode_returns", "demo_count",
    "demo_probability", "exploration_stats", "independent_pass_at_k", "meta_metrics", "num_demos", "pass_at_k",
    "reflection_advantages", "relative_attempt_advantages", "sample_demos", "success_at_attempt",
    "success_by_attempt", "trial_advantages", "trial_exploration",
]
