"""Evaluation: success on a fixed sample of tasks per split, played by the same worker as training.

``evaluate_split`` draws ``n_tasks`` tasks of a split (the same ones every time for a seed),
plays them with the rollout spec's evaluation settings (greedy by default, never any
demonstrations) and summarises them: one episode per task, or, when the evaluation plays trials of
K attempts, ``trial_summary``'s figures (``ctxrl.meta.metrics``).
"""

from __future__ import annotations

from collections import Counter

from ctxrl.types import Episode


def summarize(episodes: list[Episode]) -> dict[str, float]:
    """Success, reward, tool use and truncation rates of a list of episodes."""
    rows = [{"success": e.success, "reward": e.reward, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
             "turns": len(e.turns), "sampled_tokens": e.num_sampled_tokens, "truncation": e.truncation}
            for e in episodes]
    errored = sum(e.truncation == "error" for e in episodes)
    return rates(rows, len(episodes), errored=errored)


def rates(rows: list[dict], n: int, *, errored: int, skip_truncations: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-episode means over ``n`` (rows missing from ``n`` count as 0) and one ``truncated_*`` rate per reason."""
    n = max(n, 1)
    out = {key: sum(r[key] for r in rows) / n
           for key in ("success", "reward", "tool_calls", "tool_errors", "turns", "sampled_tokens")}
    out["errored"] = errored / n
    reasons = Counter(r["truncation"] for r in rows if r["truncation"] and r["truncation"] not in skip_truncations)
    for reason, count in reasons.items():
        out[f"truncated_{reason}"] = count / n
    return out


def evaluate_split(worker, split: str, n_tasks: int, *, seed: int,
                   trials_per_task: int = 1) -> tuple[dict[str, float], list[Episode]]:
    """Play ``n_tasks`` tasks of ``split`` with ``worker`` (evaluation settings); summary and episodes."""
    from ctxrl.meta.metrics import trial_summary
    from ctxrl.rollout.spec import RolloutRequest

    tasks = worker.env_cls.sample_tasks(split, n_tasks, seed)
    trials = worker.spec.eval_meta.num_attempts > 1
    request = RolloutRequest(tasks=tasks, group_size=trials_per_task if trials else 1, seed=seed, phase="eval")
    episodes = worker.run(request)
    return (trial_summary(episodes) if trials else summarize(episodes)), episodes
