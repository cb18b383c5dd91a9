"""Named seed streams: every seed a run derives from ``run.seed``, in one place.

A run is reproducible because each random choice draws from its own stream, named for what it
decides: the training tasks of a step, the episodes sampled for them, the warm start's demos, the
learner's mini-batch order. Each stream is a pure function of the run seed and the step (or
episode), so a stream's values do not depend on what else ran before it: a resumed run, a rollout
in another process and an uninterrupted run draw the same numbers.

The arithmetic is historical (each value is what the code before this module computed in place,
so that figures measured earlier repeat). Streams that draw from different generators may share a
value (the engine's, the learner's, the warm start's batch order and the demo choice are all the
run seed itself); streams that pick from the same space never do. Evaluation draws from its own
seed, ``eval.seed``, so that before and after compare the same tasks and samples.
``derive_seed`` turns one seed into sub-streams by salt (per turn, per summary, per attempt); the
salts live here too.
"""

from __future__ import annotations

from dataclasses import dataclass

SEED_MODULUS = 1 << 63

# Salts of the per-episode sub-streams (``derive_seed(episode_seed, salt)``).
SUMMARY_SALT = 1_000_000
"""Summary ``k`` of an episode samples with ``derive_seed(seed, SUMMARY_SALT + k)``
(turn ``t`` with ``derive_seed(seed, t)``)."""
REFLECTION_SALT = 2_000_000
"""The reflection after attempt ``k`` of a trial samples with ``derive_seed(seed, REFLECTION_SALT + k)``."""
ATTEMPT_SALT = 3_000_000
"""Attempt ``k >= 1`` of a trial plays with episode seed ``derive_seed(seed, ATTEMPT_SALT + k)``
(attempt 0 with ``seed``)."""
SELECT_SALT = 4_000_000
"""Selection ``k`` of an episode (``select``) samples with ``derive_seed(seed, SELECT_SALT + k)``."""
SEAT_SALT = 5_000_000
"""Seat ``i >= 1`` of a multi-role match plays with seed ``derive_seed(seed, SEAT_SALT + i)``; seat 0 with the
episode seed itself, so a table of one seat samples what the agent loop samples (``ctxrl.rollout.match``)."""


def seat_seed(seed: int | None, index: int) -> int | None:
    """The seed of seat ``index`` of a match seeded ``seed`` (see ``SEAT_SALT``)."""
    if seed is None or index == 0:
        return seed
    return derive_seed(seed, SEAT_SALT + index)


def derive_seed(seed: int, *salt: int) -> int:
    """A seed for a sub-stream (for example an episode's turn) that differs for every salt."""
    value = seed % SEED_MODULUS
    for s in salt:
        value = (value * 0x9E3779B97F4A7C15 + (s + 1) * 0xBF58476D1CE4E5B9) % SEED_MODULUS
        value ^= value >> 29
    return value


def episode_seed(request_seed: int, group: int, k: int) -> int:
    """Episode ``k`` of group (task) ``group`` in a rollout request seeded with ``request_seed``."""
    return request_seed * 1_000_003 + group * 1009 + k


@dataclass(frozen=True)
class Seeds:
    """The streams of one run, all derived from ``run.seed``."""

    run: int

    def tasks(self, step: int, round_: int = 0) -> int:
        """The training tasks of RL step ``step`` (``round_`` > 0: a dynamic-sampling refill)."""
        return self.run * 100_003 + step + round_ * 7_777_777

    def rollout(self, step: int, round_: int = 0) -> int:
        """The episodes played on those tasks (the rollout request's seed)."""
        return self.run * 7919 + step + round_ * 1_000_033

    @property
    def engine(self) -> int:
        """The engine's own stream, for requests that bring no seed."""
        return self.run

    @property
    def learner(self) -> int:
        """The learner's mini-batch order."""
        return self.run

    @property
    def warm_start_demos(self) -> int:
        """Which training tasks the warm start's scripted demos solve, and which take the shortcut."""
        return self.run + 77

    @property
    def trial_demos(self) -> int:
        """The warm start's scripted trials (``sft.trial_demos``)."""
        return self.run + 78

    @property
    def format_demos(self) -> int:
        """The other environment's demos of a format-only warm start (``sft.format_demos_env``)."""
        return derive_seed(self.run + 77, 1)

    def control_demos(self, step: int) -> int:
        """The fresh demos the SFT-only control trains on at its step ``step`` (``train.objective=sft``)."""
        return derive_seed(self.run + 77, 2, step)

    @property
    def sft_order(self) -> int:
        """The warm start's batch order."""
        return self.run

    @property
    def demo_pool(self) -> int:
        """The training tasks solved for the annealed demonstrations' pool."""
        return self.run + 991

    @property
    def demo_choice(self) -> int:
        """Which demonstrations an episode's prompt shows (``ctxrl.meta.anneal.sample_demos``)."""
        return self.run
