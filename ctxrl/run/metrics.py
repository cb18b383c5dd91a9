"""An RL step's metrics row (``phase = "rl"`` in ``metrics.jsonl``): the episodes' summary, the step's own figures
(dynamic sampling, curriculum, errors), the context managers', trials' and judge's statistics where they apply, the
advantages, the update's figures, token counts, times and peak memory."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ctxrl.eval.arena import role_figures
from ctxrl.judge.figures import judge_figures
from ctxrl.learner.sizing import peak_memory
from ctxrl.rollout.managers.stats import context_stats
from ctxrl.rollout.summary import summarize
from ctxrl.types import Episode, TrainSequence


def step_row(step: int, collected, valid: list[Episode], rows: list[TrainSequence], trained_episodes: int,
             update: dict[str, float], times: dict[str, float], t0: float, *, manager, spec, device: str
             ) -> dict[str, Any]:
    """The metrics row of RL step ``step`` (0-based; the row says ``step + 1``)."""
    episodes = collected.episodes
    sampled = [x for r in rows for x, m in zip(r.advantages, r.loss_mask) if m]
    return {"phase": "rl", "step": step + 1, **summarize(episodes), **_mean_terms(episodes), **collected.metrics,
            **(context_stats(episodes) if manager.rewrites_context else {}),
            **(_trial_stats(episodes) if spec.meta.num_attempts > 1 else {}),
            **({"demos_per_episode": float(np.mean([e.info.get("demos", 0) for e in episodes]))}
               if spec.max_demos else {}),
            **(judge_figures(episodes) if spec.judge.enabled else {}),
            **role_figures(episodes),
            "trained_episodes": trained_episodes, "trained_sequences": len(rows),
            "advantage_abs_mean": float(np.mean(np.abs(sampled))) if sampled else 0.0,
            "advantage_std": float(np.std(sampled)) if sampled else 0.0,
            "zero_variance_groups": _zero_variance_groups(valid),
            **update,
            "tokens": sum(len(s.input_ids) for e in episodes for s in e.sequences()),
            **times, "time_step": time.perf_counter() - t0, **peak_memory(device)}


def error_stats(episodes: list[Episode]) -> dict[str, float]:
    """Errored episodes by kind (``errors_constructor`` ... ``errors_deadline``), and what the deadline dropped.

    A deadline cuts long episodes first, so the episodes left to train on are biased short:
    ``deadline_dropped_tokens_mean`` (tokens an episode held when its deadline fired) next to
    ``kept_tokens_mean`` (tokens of the episodes that finished) shows by how much.
    """
    from ctxrl.rollout.agent import ERROR_KINDS

    errored = [e for e in episodes if e.truncation == "error"]
    out: dict[str, float] = {f"errors_{kind}": float(sum(e.info.get("error_kind") == kind for e in errored))
                             for kind in ERROR_KINDS}
    out["deadline_episodes"] = out["errors_deadline"]
    dropped = [e for e in errored if e.info.get("error_kind") == "deadline"]
    if dropped:
        kept = [e for e in episodes if e.truncation != "error"]

        def tokens(e: Episode) -> int:
            return sum(len(s.input_ids) for s in e.sequences())

        out["deadline_dropped_tokens_mean"] = sum(map(tokens, dropped)) / len(dropped)
        out["kept_tokens_mean"] = sum(map(tokens, kept)) / len(kept) if kept else 0.0
    return out


def _trial_stats(episodes: list[Episode]) -> dict[str, float]:
    from ctxrl.meta.metrics import trial_stats

    return trial_stats(episodes)


def _mean_terms(episodes: list[Episode]) -> dict[str, float]:
    """Mean of each shaped reward term (``info["reward_terms"]``) over all of a step's episodes."""
    sums: dict[str, float] = {}
    for e in episodes:
        for k, v in e.info.get("reward_terms", {}).items():
            sums[k] = sums.get(k, 0.0) + v
    return {k: v / len(episodes) for k, v in sums.items()}


def _zero_variance_groups(episodes: list[Episode]) -> int:
    by_group: dict[tuple[int, str], set[float]] = {}
    for e in episodes:
        by_group.setdefault(e.baseline_group, set()).add(e.reward)
    return sum(1 for rewards in by_group.values() if len(rewards) == 1)
