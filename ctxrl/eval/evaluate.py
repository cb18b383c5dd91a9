"""Evaluation: success on a fixed sample of tasks per split, played by the same worker as training.

``evaluate_split`` draws ``n_tasks`` tasks of a split (the same ones every time for a seed),
plays them with the rollout spec's evaluation settings (greedy by default, never any
demonstrations) and summarises them: one episode per task, or, when the evaluation plays trials of
K attempts, ``trial_summary``'s figures (``ctxrl.meta.metrics``). A multi-role environment's tasks are
matches against ``roles.eval_opponents`` (``ctxrl.eval.arena``).
"""

from __future__ import annotations

from ctxrl.rollout.summary import summarize
from ctxrl.types import Episode

__all__ = ["evaluate_split", "summarize"]


def evaluate_split(worker, split: str, n_tasks: int, *, seed: int, trials_per_task: int = 1,
                   on_episode=None) -> tuple[dict[str, float], list[Episode]]:
    """Play ``n_tasks`` tasks of ``split`` with ``worker`` (evaluation settings); summary and episodes.

    ``on_episode(done, total)`` after each episode (or trial) finishes: progress for a display.
    """
    from ctxrl.envs.roles import is_multi_role
    from ctxrl.meta.metrics import trial_summary
    from ctxrl.rollout.spec import RolloutRequest

    if is_multi_role(worker.env_cls):
        from ctxrl.eval.arena import evaluate_matches

        return evaluate_matches(worker, split, n_tasks, seed=seed, opponents=worker.spec.roles.eval_opponents,
                                on_episode=on_episode)
    tasks = worker.env_cls.sample_tasks(split, n_tasks, seed)
    trials = worker.spec.eval_meta.num_attempts > 1
    request = RolloutRequest(tasks=tasks, group_size=trials_per_task if trials else 1, seed=seed, phase="eval")
    episodes = worker.run(request, on_episode=on_episode)
    return (trial_summary(episodes) if trials else summarize(episodes)), episodes
