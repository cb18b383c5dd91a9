"""Evaluation: success on a fixed sample of tasks per split, with the same agent loop as training."""

from __future__ import annotations

from collections import Counter

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Engine
from ctxrl.rollout.agent import RolloutLimits, run_episodes
from ctxrl.types import Episode


def summarize(episodes: list[Episode]) -> dict[str, float]:
    """Success, reward, tool use and truncation rates of a list of episodes."""
    n = max(len(episodes), 1)
    truncations = Counter(e.truncation for e in episodes if e.truncation)
    out = {
        "success": sum(e.success for e in episodes) / n,
        "reward": sum(e.reward for e in episodes) / n,
        "tool_calls": sum(e.tool_calls for e in episodes) / n,
        "tool_errors": sum(e.tool_errors for e in episodes) / n,
        "turns": sum(len(e.turns) for e in episodes) / n,
        "sampled_tokens": sum(e.num_sampled_tokens for e in episodes) / n,
        "errored": sum(e.truncation == "error" for e in episodes) / n,
    }
    for reason, count in truncations.items():
        out[f"truncated_{reason}"] = count / n
    return out


async def evaluate_split(env_cls, split: str, n_tasks: int, engine: Engine, renderer: ChatRenderer,
                         limits: RolloutLimits, *, seed: int) -> tuple[dict[str, float], list[Episode]]:
    """Play one episode per task on ``n_tasks`` tasks of ``split`` (seeded), return summary and episodes."""
    tasks = env_cls.sample_tasks(split, n_tasks, seed)
    episodes = await run_episodes(env_cls, tasks, engine, renderer, limits, group_size=1, seed=seed)
    return summarize(episodes), episodes
