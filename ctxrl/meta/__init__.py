"""Learning across episodes (meta-RL): credit across the attempts of a trial, annealed
demonstrations, and trial statistics. Pure functions over plain data (no torch); the
multi-attempt rollout is ``ctxrl.rollout.meta``, demonstrations in prompts ``ctxrl.rollout.demos``,
the trainer's side ``ctxrl.train.trials`` (docs/meta.md)."""

from ctxrl.meta.anneal import DemoSchedule, demo_count, demo_probability, num_demos, sample_demos
from ctxrl.meta.credit import (cross_episode_advantages, cross_episode_returns, reflection_advantages,
                               relative_attempt_advantages, trial_advantages)
from ctxrl.meta.stats import (exploration_stats, independent_pass_at_k, meta_metrics, pass_at_k, success_at_attempt,
                              success_by_attempt, trial_exploration)
from ctxrl.meta.trial import Attempt, Trial

__all__ = [
    "Attempt", "DemoSchedule", "Trial", "cross_episode_advantages", "cross_episode_returns", "demo_count",
    "demo_probability", "exploration_stats", "independent_pass_at_k", "meta_metrics", "num_demos", "pass_at_k",
    "reflection_advantages", "relative_attempt_advantages", "sample_demos", "success_at_attempt",
    "success_by_attempt", "trial_advantages", "trial_exploration",
]
