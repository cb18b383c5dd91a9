"""The environment ``benchmarks/train_step.py`` times ``ctxrl train`` on: one turn, a prompt of a known length, a
random reward.

A random-init policy never stops on its own, so every reply runs to ``rollout.max_new_tokens``: the step's work
is fixed (prompts x generations x that many tokens), as in the GRPO workloads peers publish. The prompt is
``CTXRL_BENCH_PROMPT_WORDS`` (default 120) words drawn from ``ctxrl.models.shapes.BENCH_WORDS``, one token each
under ``save_random_checkpoint``'s tokenizer. The reward is a uniform draw in [0, 1) seeded by the task and the
reply, so groups are never all equal and every step updates.

Used as ``env.name = "fixed_length:FixedLengthEnv"`` with ``benchmarks/envs/`` on ``PYTHONPATH``. Not an
environment to learn anything in.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import ClassVar

from ctxrl.envs.base import EnvError
from ctxrl.models.shapes import BENCH_WORDS
from ctxrl.tasks import ContextParam, ContextSpace, sample_tasks
from ctxrl.types import Message, StepResult, Task


def prompt_words() -> int:
    return int(os.environ.get("CTXRL_BENCH_PROMPT_WORDS", "120"))


def _generate(context, rng: random.Random):
    words = " ".join(rng.choice(BENCH_WORDS) for _ in range(prompt_words()))
    return words, "", {}


class FixedLengthEnv:
    """One reply to a prompt of random words; a random reward."""

    name: ClassVar[str] = "fixed_length"
    system_prompt: ClassVar[str] = "Reply."
    context_space: ClassVar[ContextSpace] = ContextSpace([
        ContextParam("variant", "int", low=0, high=1000, default=0, ood_low=1001, ood_high=2000,
                     description="a label only: every task is a prompt of random words")])

    def __init__(self) -> None:
        self.tools = []
        self._task: Task | None = None

    @classmethod
    def sample_tasks(cls, split, n, seed):
        return sample_tasks(_generate, cls.context_space, split, n, seed, id_prefix=cls.name)

    @classmethod
    def solve(cls, task):
        return ["done"]

    def reset(self, task, *, seed=None):
        self._task = task
        return [Message("system", self.system_prompt), Message("user", task.prompt)]

    async def step(self, message):
        if self._task is None:
            raise EnvError("step() after the episode ended; call reset() first")
        digest = hashlib.sha256(f"{self._task.id}\0{message.content}".encode()).digest()
        self._task = None
        reward = int.from_bytes(digest[:8], "big") / 2**64
        return StepResult([], reward=reward, terminated=True, info={"success": reward >= 0.5})

    def close(self):
        self._task = None
