"""The environment ``benchmarks/train_step.py --partial`` times partial rollouts on: episodes of several turns, how
many drawn from a long-tailed list, so that a step that waits for its episodes waits for a few long ones.

Each episode takes a number of turns its seed draws from ``CTXRL_BENCH_TURNS`` (default ``1,1,1,1,2,2,3,4,6,8``: most
episodes short, a few long); the environment answers every turn but the last with ``CTXRL_BENCH_OBS_WORDS`` (16)
words, and the last with a random reward in [0, 1), seeded by the task and the reply as ``fixed_length``'s. The prompt
is ``fixed_length``'s. Whatever the policy writes, only the count of turns matters. A random policy ends a turn only
where it samples a stop id (the benchmark names every ``--stop-every``-th id of the vocabulary, so its turns run
lengths of about that many tokens); a turn cut at ``rollout.max_new_tokens`` ends its episode, as the agent loop does.

Used as ``env.name = "long_tail:LongTailEnv"`` with ``benchmarks/envs/`` on ``PYTHONPATH``. Not an environment to
learn anything in.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import ClassVar

from fixed_length import FixedLengthEnv

from ctxrl.envs.base import EnvError
from ctxrl.models.shapes import BENCH_WORDS
from ctxrl.types import Message, StepResult


def turn_counts() -> list[int]:
    return [int(n) for n in os.environ.get("CTXRL_BENCH_TURNS", "1,1,1,1,2,2,3,4,6,8").split(",")]


def observation_words() -> int:
    return int(os.environ.get("CTXRL_BENCH_OBS_WORDS", "16"))


class LongTailEnv(FixedLengthEnv):
    """A prompt of random words; a number of turns drawn by the episode's seed; a random reward after the last."""

    name: ClassVar[str] = "long_tail"

    def reset(self, task, *, seed=None):
        self.rng = random.Random(seed)
        self.left = self.rng.choice(turn_counts())
        return super().reset(task, seed=seed)

    async def step(self, message):
        if self._task is None:
            raise EnvError("step() after the episode ended; call reset() first")
        self.left -= 1
        if self.left > 0:
            words = " ".join(self.rng.choice(BENCH_WORDS) for _ in range(observation_words()))
            return StepResult([Message("user", words)])
        digest = hashlib.sha256(f"{self._task.id}\0{message.content}".encode()).digest()
        self._task = None
        reward = int.from_bytes(digest[:8], "big") / 2**64
        return StepResult([], reward=reward, terminated=True, info={"success": reward >= 0.5})
