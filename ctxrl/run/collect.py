"""Phase 1 of an RL step: play the step's episodes (``Collector.collect``).

Each step draws ``rollout.tasks_per_step`` tasks from the curriculum and plays ``rollout.group_size``
episodes of each with the rollout worker, rewards shaped. DAPO's dynamic sampling plays more rounds until
enough groups are informative; with ``distributed.max_staleness > 0`` on Ray the next step's episodes are
started while this step trains (``asynchronous_round``), and in one process they are played with weights held
that many versions back (``lagged_round``); with ``rollout.partial_step_tokens`` episodes that outlive the step are
carried over to the next (``ctxrl.run.partial``). Round 0 of step ``s`` always draws the same tasks and seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxrl.algo.filters import informative_groups
from ctxrl.config import Config
from ctxrl.rollout.managers.stats import scheduled_budget
from ctxrl.rollout.spec import RolloutRequest
from ctxrl.run.partial import partial_round
from ctxrl.run.rewards import shape_rewards
from ctxrl.seeds import Seeds
from ctxrl.types import Episode


@dataclass
class Collected:
    """What a step's rollout gave: every episode played, the ones chosen to train on, and its figures."""

    episodes: list[Episode]
    train: list[Episode]
    metrics: dict[str, Any] = field(default_factory=dict)


def trainable(e: Episode) -> bool:
    """Not errored, something was sampled in it, and its policy trains (not a pinned seat of a match: a frozen
    checkpoint's turns carry log-probs, but are never the learner's to train on)."""
    return (e.truncation != "error" and e.info.get("trains", True) is not False
            and any(any(s.loss_mask) for s in e.sequences()))


class Collector:
    """Plays each RL step's episodes with ``worker``: the tasks the ``curriculum`` draws, the seeds ``seeds`` gives."""

    def __init__(self, config: Config, worker, env_cls: type, curriculum, seeds: Seeds) -> None:
        self.config, self.worker, self.env_cls, self.curriculum, self.seeds = config, worker, env_cls, curriculum, seeds
        self._prefetched: tuple[int, Any] | None = None  # (step, submitted request): asynchronous rollouts

    def rollout_round(self, step: int, round_: int) -> list[Episode]:
        """One round of ``tasks_per_step`` fresh tasks x ``group_size`` episodes, rewards shaped.

        Round 0 of step ``s`` always draws the same tasks and seeds; later rounds (dynamic
        sampling) draw new ones, and their group ids follow on from the earlier rounds'.
        """
        c = self.config
        episodes = self.worker.run(self.rollout_request(step, round_))
        shape_rewards(episodes, c.reward, max_total_tokens=c.rollout.max_total_tokens,
                      judge=c.settings_of("reward", "judge"))
        return episodes

    def rollout_request(self, step: int, round_: int) -> RolloutRequest:
        c = self.config
        n, g = c.rollout.tasks_per_step, c.rollout.group_size
        tasks = self.curriculum.sample_tasks(self.env_cls, n, self.seeds.tasks(step, round_), step)
        return RolloutRequest(tasks=tasks, group_size=g, seed=self.seeds.rollout(step, round_), phase="train",
                              step=step, first_episode=round_ * n * g, group_offset=round_ * n,
                              max_turns=self.curriculum.max_turns(step, c.env.max_turns),
                              context_budget=self.context_budget(step))

    def asynchronous_round(self, step: int) -> Collected:
        """Step ``step``'s episodes, started during the previous step's update, and the next step's started now.

        The actors play the next step's request with the weights they hold until this step's
        ``load_weights`` reaches them (it queues behind that request), so its episodes are one version
        old: staleness 1. Episodes more than ``distributed.max_staleness`` versions behind the learner's
        are dropped (counted in ``stale_dropped``); the decoupled objective corrects the rest.
        """
        if self._prefetched is not None and self._prefetched[0] == step:
            submitted = self._prefetched[1]
        else:
            submitted = self.worker.submit(self.rollout_request(step, 0))
        self._prefetched = None
        if step + 1 < self.config.train.steps:
            self._prefetched = (step + 1, self.worker.submit(self.rollout_request(step + 1, 0)))
        episodes = self.worker.collect(submitted)
        current, eta = self.worker.policy_version, self.config.distributed.max_staleness
        # (a pinned seat, scripted or frozen, is played by a policy that never moves: it is never stale)
        trains = [e for e in episodes if e.info.get("trains", True)]
        kept = [e for e in episodes if not e.info.get("trains", True) or current - e.policy_version <= eta]
        ages = [current - e.policy_version for e in trains]
        shape_rewards(kept, self.config.reward, max_total_tokens=self.config.rollout.max_total_tokens,
                      judge=self.config.settings_of("reward", "judge"))
        return Collected(kept, kept, {"staleness_mean": sum(ages) / max(len(ages), 1),
                                      "staleness_max": float(max(ages, default=0)),
                                      "stale_dropped": float(len(episodes) - len(kept))})

    def lagged_round(self, step: int) -> Collected:
        """Step ``step``'s episodes in one process with the engine's weights held ``distributed.max_staleness``
        versions behind the learner's (``ctxrl.distributed.staleness``): the learner is at version ``step``."""
        episodes = self.rollout_round(step, 0)
        ages = [step - e.policy_version for e in episodes if e.info.get("trains", True)]
        return Collected(episodes, episodes, {"staleness_mean": sum(ages) / max(len(ages), 1),
                                              "staleness_max": float(max(ages, default=0)), "stale_dropped": 0.0})

    def context_budget(self, step: int) -> int:
        """The working-context budget of RL step ``step`` (the budget curriculum, if any)."""
        c = self.config.context
        return scheduled_budget(step, final=c.max_context_tokens, start=c.budget_start_tokens, steps=c.budget_steps)

    def collect(self, step: int) -> Collected:
        """Phase 1: play the step's episodes; with dynamic sampling, rounds until enough groups are informative."""
        c = self.config
        if c.rollout.partial_step_tokens > 0:  # episodes that outlive the step (ctxrl.run.partial)
            episodes, metrics = partial_round(self, step)
            return Collected(episodes, episodes, metrics)
        if c.distributed.max_staleness > 0:
            return self.asynchronous_round(step) if c.distributed.backend == "ray" else self.lagged_round(step)
        if not c.algo.dynamic_sampling:
            episodes = self.rollout_round(step, 0)
            return Collected(episodes, episodes)
        episodes: list[Episode] = []
        kept: list[int] = []
        rounds = 0
        for round_ in range(1 + c.algo.dynamic_sampling_rounds):
            batch = self.rollout_round(step, round_)
            rounds += 1
            episodes += batch
            ok = [e for e in batch if trainable(e)]
            keys: dict[tuple[int, str], int] = {}  # a group's roles are judged apart (a match's seats)
            informative = informative_groups([e.reward for e in ok],
                                             [keys.setdefault(e.baseline_group, len(keys)) for e in ok])
            for g in dict.fromkeys(e.group_id for e, keep in zip(ok, informative) if keep):
                if len(kept) < c.rollout.tasks_per_step:
                    kept.append(g)
            if len(kept) >= c.rollout.tasks_per_step:
                break
        chosen = set(kept)
        return Collected(episodes, [e for e in episodes if e.group_id in chosen],
                         {"dynamic_sampling_rounds": rounds, "dynamic_sampling_groups_kept": len(kept),
                          "dynamic_sampling_groups_dropped": rounds * c.rollout.tasks_per_step - len(kept)})
