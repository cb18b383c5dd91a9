"""What trials are measured by, in training and at evaluation: success at and by each attempt, and why later ones fail.

``trial_summary`` is an evaluation's: its ``success``, ``reward``, ``tool_calls``... are attempt 1's,
exactly what a single-episode evaluation reports (attempt 1 is the zero-context policy), and
``meta_metrics`` adds ``success_at_k``, ``success_by_k``, ``pass_at_k`` (of independent first
attempts, with enough trials per task), exploration and ``per_attempt`` diagnostics (tool errors,
turns, prompt length). ``trial_success`` is success by attempt K over all trials (errored ones
count as failures). ``trial_stats`` is a training step's.
"""

from __future__ import annotations

from ctxrl.meta.stats import meta_metrics
from ctxrl.meta.trial import Attempt, Trial
from ctxrl.rollout.summary import rates
from ctxrl.types import Episode


def to_trial(episode: Episode) -> Trial:
    """The statistics' view of a played trial (``ctxrl.meta.Trial``); a plain episode is a one-attempt trial."""
    records = episode.info.get("attempts")
    if records is None:
        return Trial(episode.task.id, 1, [Attempt(episode.reward, episode.success)])
    return Trial(episode.task.id, episode.info["num_attempts"],
                 [Attempt(r["reward"], r["success"], list(r["actions"]), r.get("failed_actions")) for r in records])


def attempt_summary(trials: list[Episode], index: int = 0) -> dict[str, float]:
    """``summarize``'s keys for attempt ``index`` of each trial (a trial that errored first counts as errored)."""
    records = [t.info["attempts"][index] if len(t.info.get("attempts", [])) > index else None for t in trials]
    errored = sum(1 for t, r in zip(trials, records)
                  if (r is None and t.truncation == "error") or (r is not None and r["truncation"] == "error"))
    return rates([r for r in records if r is not None], len(trials), errored=errored, skip_truncations=("error",))


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


def trial_summary(trials: list[Episode]) -> dict[str, float]:
    """An evaluation's figures over trials (see the module docstring)."""
    summary = attempt_summary(trials, 0)
    played = [t for t in trials if t.truncation != "error"]
    if played:
        summary.update(meta_metrics([to_trial(t) for t in played]))
        summary["reflections_per_trial"] = sum(t.info["reflections"] for t in played) / len(played)
        summary.update(per_attempt(played))
    summary["trial_success"] = sum(t.success and t.truncation != "error" for t in trials) / max(len(trials), 1)
    return summary


def trial_stats(trials: list[Episode]) -> dict[str, float]:
    """A training step's trial figures: success at / by attempt, attempts and reflections per trial.

    Errored trials are left out."""
    played = [t for t in trials if t.truncation != "error"]
    if not played:
        return {}
    return {**meta_metrics([to_trial(t) for t in played]),
            "reflections_per_trial": sum(t.info["reflections"] for t in played) / len(played),
            "reflections_skipped_per_trial": sum(t.info["reflections_skipped"] for t in played) / len(played),
            "reflection_tokens_mean": sum(t.info["reflection_tokens"] for t in played)
            / max(sum(t.info["reflections"] for t in played), 1)}
