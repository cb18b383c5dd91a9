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

__all__ = ["evaluate_split", "summarize", "task_outcomes"]


def task_outcomes(episodes: list[Episode]) -> dict[str, dict]:
    """Each task's outcome, for statistics over tasks as well as seeds (``experiments/tables.py``).

    ``task_success``: task id -> mean success over its episodes (its trials: attempt 1's, as the evaluation row's
    ``success``; an errored one is a failure). Trials add ``task_success_by_attempt``: task id -> success
    by attempt k for k = 1..K, averaged over its trials. A rewriting manager's ``fact_survival`` pairs add
    ``task_fact_survival``: task id -> facts kept / facts seen over its rewrites (tasks with none left out); single
    episodes add ``task_facts_at_answer``: of the answer's facts, the share in context when it answered.
    """
    from ctxrl.rollout.managers.facts import episode_survival, facts_at_answer

    by_task: dict[str, list[Episode]] = {}
    for e in episodes:
        by_task.setdefault(e.task.id, []).append(e)
    out: dict[str, dict] = {"task_success": {t: sum(e.success and e.truncation != "error" for e in es) / len(es)
                                             for t, es in by_task.items()}}
    if any("attempts" in e.info for e in episodes):
        by_attempt = {t: _by_attempt(es) for t, es in by_task.items()}
        out["task_success_by_attempt"] = by_attempt
        out["task_success"] = {t: k[0] for t, k in by_attempt.items()}  # attempt 1's, as the row's ``success``
    survival = {t: [episode_survival(e) for e in es] for t, es in by_task.items()}
    scored = {t: (sum(k for k, _ in p), sum(s for _, s in p)) for t, p in survival.items()}
    if any(seen for _, seen in scored.values()):
        out["task_fact_survival"] = {t: kept / seen for t, (kept, seen) in scored.items() if seen}
    at_answer = {t: [v for v in map(facts_at_answer, es) if v is not None] for t, es in by_task.items()}
    if any("attempts" not in e.info for e in episodes) and any(at_answer.values()):
        out["task_facts_at_answer"] = {t: sum(v) / len(v) for t, v in at_answer.items() if v}
    return out


def _by_attempt(trials: list[Episode]) -> list[float]:
    """Success by attempt k (1..K: any of the first k succeeded), averaged over ``trials``; a trial that stopped
    early on a success counts as solved at every later k, one that errored as failed."""
    k_max = max(e.info.get("num_attempts", len(e.info.get("attempts", [])) or 1) for e in trials)
    rows = []
    for e in trials:
        attempts = [bool(r["success"]) and r.get("truncation") != "error" for r in e.info.get("attempts", [])]
        rows.append([any(attempts[:k]) for k in range(1, k_max + 1)])
    return [sum(r[k] for r in rows) / len(rows) for k in range(k_max)]


def evaluate_split(worker, split: str, n_tasks: int, *, seed: int, trials_per_task: int = 1,
                   on_episode=None) -> tuple[dict[str, float], list[Episode]]:
    """Play ``n_tasks`` tasks of ``split`` with ``worker`` (evaluation settings); summary and episodes.

    ``on_episode(done, total)`` after each episode (or trial) finishes: progress for a display.
    """
    from ctxrl.envs.roles import is_multi_role
    from ctxrl.meta.metrics import trial_summary
    from ctxrl.rollout.spec import RolloutRequest, attempts_of

    if is_multi_role(worker.env_cls):
        from ctxrl.eval.arena import evaluate_matches

        return evaluate_matches(worker, split, n_tasks, seed=seed, opponents=tuple(worker.spec.roles.eval_opponents),
                                on_episode=on_episode)
    tasks = worker.env_cls.sample_tasks(split, n_tasks, seed)
    trials = attempts_of(worker.spec.meta, "eval") > 1
    request = RolloutRequest(tasks=tasks, group_size=trials_per_task if trials else 1, seed=seed, phase="eval")
    episodes = worker.run(request, on_episode=on_episode)
    return (trial_summary(episodes) if trials else summarize(episodes)), episodes
