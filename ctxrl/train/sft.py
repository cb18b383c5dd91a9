"""Supervised warm start on the environment's scripted solutions.

Demonstrations are played through the real agent loop with a ``ScriptedEngine``, so their ids,
masks and observations are built exactly like RL rollouts; the loss is cross-entropy on the
mask-1 (assistant) tokens only. ``shortcut_fraction`` of the demos use the environment's
``shortcut`` (an answer without the tool) when it has one: the warm start is imperfect on
purpose, so RL has something real to fix.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Callable

import torch

from ctxrl.chat.render import ChatRenderer
from ctxrl.envs.base import pretraining_env
from ctxrl.rollout.agent import RolloutLimits, run_episode
from ctxrl.rollout.scripted import ScriptedEngine
from ctxrl.train.learner import collate, token_logprobs
from ctxrl.types import Episode


WORLD_EPISODES = 100
"""Demos drawn from one world before the next, when demos come from other worlds."""


async def build_demos(env_cls, renderer: ChatRenderer, n: int, *, shortcut_fraction: float = 0.0,
                      seed: int = 0, limits: RolloutLimits | None = None, other_worlds: bool = False) -> list[Episode]:
    """Play ``n`` scripted episodes on training tasks; raises if a script does not fit the limits.

    ``other_worlds``: for an environment with a ``pretraining_variant`` (``search_qa``), draw the
    demos from a fresh variant every ``WORLD_EPISODES`` episodes (many invented worlds), so they
    teach the skill (search, read, copy) and no world's facts can be memorised.
    """
    if other_worlds and getattr(env_cls, "pretraining_variant", None) is not None:
        episodes: list[Episode] = []
        for start in range(0, n, WORLD_EPISODES):
            world = pretraining_env(env_cls, seed * 100_003 + start // WORLD_EPISODES)
            episodes += await build_demos(world, renderer, min(WORLD_EPISODES, n - start), seed=seed + start,
                                          shortcut_fraction=shortcut_fraction, limits=limits)
        return episodes
    limits = limits or RolloutLimits(max_turns=16, max_new_tokens=4096, max_total_tokens=1 << 20)
    tasks = env_cls.sample_tasks("train", n, seed)
    rng = random.Random(seed)
    shortcut = getattr(env_cls, "shortcut", None)
    jobs = []
    for task in tasks:
        use_shortcut = shortcut is not None and rng.random() < shortcut_fraction
        texts = shortcut(task) if use_shortcut else env_cls.solve(task)
        jobs.append(run_episode(env_cls(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=seed))
    episodes = list(await asyncio.gather(*jobs))
    for ep in episodes:
        if ep.truncation is not None:
            raise RuntimeError(f"demonstration for task {ep.task.id} ended early ({ep.truncation}: "
                               f"{ep.info.get('error', '')}); check the env's solve() and the rollout limits")
    return episodes


def sft_train(model, episodes: list[Episode], *, pad_token_id: int, epochs: int, batch_size: int, lr: float,
              seed: int = 0, on_step: Callable[[int, int, float], None] | None = None) -> list[float]:
    """Cross-entropy on mask-1 tokens, token-mean per batch; returns the loss of every step."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    steps_per_epoch = math.ceil(len(episodes) / batch_size)
    total = steps_per_epoch * epochs
    warmup = max(1, total // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(episodes), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            batch = collate([episodes[i] for i in order[start:start + batch_size]], pad_token_id, device)
            logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask)
            loss = -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1.0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(len(losses), total, losses[-1])
    return losses
