"""Evaluation: success on a fixed sample of tasks per split, with the same agent loop as training.

``evaluate_split`` plays one episode per task. ``evaluate_trials`` plays trials of K attempts
(``ctxrl.rollout.meta``): its ``success``, ``reward``, ``tool_calls``... are attempt 1's, exactly
what ``evaluate_split`` reports (attempt 1 is the zero-context policy), and ``meta_metrics`` adds
``success_at_k``, ``success_by_k``, ``pass_at_k`` (of independent first attempts, with enough
trials per task), exploration and ``per_attempt`` diagnostics (tool errors, turns, prompt length).
``trial_success`` is success by attempt K over all trials (errored ones count as failures). Neither ever shows demonstrations: evaluation is zero-shot.
"""

from __future__ import annotations

from collections import Counter

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Engine
from ctxrl.meta.stats import meta_metrics
from ctxrl.rollout.agent import RolloutLimits, run_episodes
from ctxrl.rollout.meta import MetaPolicy, run_trials, to_trial
from ctxrl.types import Episode


def summarize(episodes: list[Episode]) -> dict[str, float]:
    """Success, reward, tool use and truncation rates of a list of episodes."""
    rows = [{"success": e.success, "reward": e.reward, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
             "turns": len(e.turns), "sampled_tokens": e.num_sampled_tokens, "truncation": e.truncation}
            for e in episodes]
    errored = sum(e.truncation == "error" for e in episodes)
    return _rates(rows, len(episodes), errored=errored)


def _rates(rows: list[dict], n: int, *, errored: int, skip_truncations: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-episode means over ``n`` (rows missing from ``n`` count as 0) and one ``truncated_*`` rate per reason."""
    n = max(n, 1)
    out = {key: sum(r[key] for r in rows) / n
           for key in ("success", "reward", "tool_calls", "tool_errors", "turns", "sampled_tokens")}
    out["errored"] = errored / n
    reasons = Counter(r["truncation"] for r in rows if r["truncation"] and r["truncation"] not in skip_truncations)
    for reason, count in reasons.items():
        out[f"truncated_{reason}"] = count / n
    return out


async def evaluate_split(env_cls, split: str, n_tasks: int, engine: Engine, renderer: ChatRenderer,
                         limits: RolloutLimits, *, seed: int) -> tuple[dict[str, float], list[Episode]]:
    """Play one episode per task on ``n_tasks`` tasks of ``split`` (seeded), return summary and episodes."""
    tasks = env_cls.sample_tasks(split, n_tasks, seed)
    episodes = await run_episodes(env_cls, tasks, engine, renderer, limits, group_size=1, seed=seed)
    return summarize(episodes), episodes


def attempt_summary(trials: list[Episode], index: int = 0) -> dict[str, float]:
    """``summarize``'s keys for attempt ``index`` of each trial (a trial that errored first counts as errored)."""
    records = [t.info["attempts"][index] if len(t.info.get("attempts", [])) > index else None for t in trials]
    errored = sum(1 for t, r in zip(trials, records)
                  if (r is None and t.truncation == "error") or (r is not None and r["truncation"] == "error"))
    return _rates([r for r in records if r is not None], len(trials), errored=errored, skip_truncations=("error",))


def per_attempt(trials: list[Episode]) -> dict[str, float]:
    """Means over the trials that played attempt k (1-based) of what can tell why a later attempt fails:
    ``tool_errors_at_k`` (invalid calls, wrong tools), ``turns_at_k`` and ``opening_tokens_at_k`` (the prompt
    that the carried notes or attempts make)."""
    out: dict[str, float] = {}
    longest = max(len(t.info["attempts"]) for t in trials)
    for k in range(longest):
        records = [t.info["attempts"][k] for t in trials if len(t.info["attempts"]) > k]
        for key in ("tool_errors", "turns", "opening_tokens"):
            out[f"{key}_at_{k + 1}"] = sum(r[key] for r in records) / len(records)
    return out


async def evaluate_trials(env_cls, split: str, n_tasks: int, engine: Engine, renderer: ChatRenderer,
                          limits: RolloutLimits, policy: MetaPolicy, *, trials_per_task: int = 1,
                          seed: int) -> tuple[dict[str, float], list[Episode]]:
    """Play ``trials_per_task`` trials on each of ``n_tasks`` tasks of ``split`` (seeded); summary and trials."""
    tasks = env_cls.sample_tasks(split, n_tasks, seed)
    trials = await run_trials(env_cls, tasks, engine, renderer, limits, policy, group_size=trials_per_task, seed=seed)
    summary = attempt_summary(trials, 0)
    played = [t for t in trials if t.truncation != "error"]
    if played:
        summary.update(meta_metrics([to_trial(t) for t in played]))
        summary["reflections_per_trial"] = sum(t.info["reflections"] for t in played) / len(played)
        summary.update(per_attempt(played))
    summary["trial_success"] = sum(t.success and t.truncation != "error" for t in trials) / max(len(trials), 1)
    return summary, trials
