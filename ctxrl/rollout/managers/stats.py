"""Working-context figures of a batch of episodes, and the budget curriculum.

``context_stats`` is what the trainer and the evaluation log when a manager rewrites the context:
tokens per generation, the peak context, summaries, windows, branches and selections per episode, how many
tokens the manager kept out of the context, success with and without a summary, and how many of the facts the
answer needs each rewrite kept (``fact_survival``, ``ctxrl.rollout.managers.facts``).
``scheduled_budget`` is the shrinking-budget curriculum (BACM-style, ``context.budget_start_tokens``).
"""

from __future__ import annotations

from ctxrl.rollout.managers.facts import answered_rate, survival_rate
from ctxrl.types import Episode


def context_stats(episodes: list[Episode]) -> dict[str, float]:
    """Working-context metrics: tokens per generation, peak context, summaries, summary length."""
    if not episodes:
        return {}
    peaks = [max(len(s.input_ids) for s in e.sequences()) for e in episodes]
    summaries = [e.info.get("summaries", 0) for e in episodes]
    selections = [e.info.get("selections", 0) for e in episodes]
    total_summary_tokens = sum(e.info.get("summary_tokens", 0) for e in episodes)
    full = [sum(len(s.input_ids) for s in e.sequences()) for e in episodes]
    n = len(episodes)
    survival, scored = survival_rate(episodes)
    at_answer, answered = answered_rate(episodes)
    return {
        "context_peak_tokens_mean": sum(peaks) / n,
        "context_peak_tokens_max": float(max(peaks)),
        "summaries_per_episode": sum(summaries) / n,
        "windows_per_episode": sum(e.info.get("windows", 0) for e in episodes) / n,
        "branches_per_episode": sum(e.info.get("branches", 0) for e in episodes) / n,
        "branches_returned_per_episode": sum(s.ended_by == "fold" for e in episodes for s in e.segments) / n,
        "summary_tokens_mean": total_summary_tokens / max(sum(summaries), 1),
        "selections_per_episode": sum(selections) / n,
        "turns_kept_per_selection": sum(e.info.get("turns_kept", 0) for e in episodes) / max(sum(selections), 1),
        "select_fallbacks_per_episode": sum(e.info.get("select_fallbacks", 0) for e in episodes) / n,
        "select_tokens_mean": sum(e.info.get("select_tokens", 0) for e in episodes) / max(sum(selections), 1),
        "context_tokens_saved": (sum(full) - sum(peaks)) / n,
        "success_with_summary": _rate([e.success for e, k in zip(episodes, summaries) if k]),
        "success_without_summary": _rate([e.success for e, k in zip(episodes, summaries) if not k]),
        "fact_survival": survival,
        "fact_survival_rewrites": float(scored),
        "facts_at_answer": at_answer,
        "facts_at_answer_episodes": float(answered),
    }


def _rate(values: list[bool]) -> float:
    return sum(values) / len(values) if values else float("nan")


def scheduled_budget(step: int, *, final: int, start: int = 0, steps: int = 0) -> int:
    """The context budget at RL ``step`` under a shrinking-budget curriculum (BACM-style).

    Linear from ``start`` at step 0 to ``final`` at step ``steps``, then ``final``; ``start`` of 0
    (or ``steps`` of 0) means no curriculum: always ``final``.
    """
    if start <= 0 or steps <= 0 or step >= steps:
        return final
    return round(start + (final - start) * step / steps)
