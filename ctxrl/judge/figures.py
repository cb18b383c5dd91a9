"""What a step's judged episodes say about the judge: the distribution of its scores, its calls, and how well it
agrees with the environment's verifier (which a judge-rewarded run may hide from training, but still measures).

Agreement counts an episode as passed by the judge when its score is at least ``PASS`` (0.5), and compares that
with the verifier's ``success``; ``judge_score_verified`` / ``judge_score_unverified`` are the mean scores of the
episodes the verifier passed and failed, and ``judge_verifier_corr`` the Pearson correlation of score and success
(when both vary within the step).
"""

from __future__ import annotations

import statistics

from ctxrl.types import Episode

PASS = 0.5
BINS = 5
"""The score histogram's bins over [0, 1]: ``judge_score_bin0`` ([0, 0.2)) ... ``judge_score_bin4`` ([0.8, 1])."""


def judge_figures(episodes: list[Episode]) -> dict[str, float]:
    """The figures above for a step's episodes; {} when none was sent to the judge."""
    asked = [e for e in episodes if "judge" in e.info]
    if not asked:
        return {}
    graded = [e for e in asked if "score" in e.info["judge"]]
    out = {"judge_episodes": float(len(graded)), "judge_failed": float(len(asked) - len(graded))}
    if not graded:
        return out
    verdicts = [e.info["judge"] for e in graded]
    scores = [v["score"] for v in verdicts]
    out.update(score_distribution(scores))
    out["judge_cached"] = sum(bool(v.get("cached")) for v in verdicts) / len(verdicts)
    out["judge_attempts_mean"] = statistics.fmean(v.get("attempts", 0) for v in verdicts)
    out["judge_seconds_mean"] = statistics.fmean(v.get("seconds", 0.0) for v in verdicts)
    for name in sorted({k for v in verdicts for k in v.get("scores", {})}):
        values = [v["scores"][name] for v in verdicts if name in v.get("scores", {})]
        out[f"judge_item_{name.replace(' ', '_')}"] = statistics.fmean(values)
    out.update(agreement(scores, [e.success for e in graded]))
    return out


def score_distribution(scores: list[float]) -> dict[str, float]:
    """Mean, spread, quantiles and a 5-bin histogram (fractions) of scores in [0, 1]."""
    ordered = sorted(scores)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    out = {"judge_score_mean": statistics.fmean(scores),
           "judge_score_std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
           "judge_score_min": ordered[0], "judge_score_p10": quantile(0.1), "judge_score_p50": quantile(0.5),
           "judge_score_p90": quantile(0.9), "judge_score_max": ordered[-1]}
    for b in range(BINS):
        inside = [s for s in scores if b / BINS <= s < (b + 1) / BINS or (b == BINS - 1 and s == 1.0)]
        out[f"judge_score_bin{b}"] = len(inside) / len(scores)
    return out


def agreement(scores: list[float], success: list[bool]) -> dict[str, float]:
    """The judge (score >= ``PASS``) against the verifier (``success``)."""
    out = {"judge_agreement": statistics.fmean(float((s >= PASS) == ok) for s, ok in zip(scores, success))}
    passed = [s for s, ok in zip(scores, success) if ok]
    failed = [s for s, ok in zip(scores, success) if not ok]
    if passed:
        out["judge_score_verified"] = statistics.fmean(passed)
    if failed:
        out["judge_score_unverified"] = statistics.fmean(failed)
    if passed and failed and len(set(scores)) > 1:
        out["judge_verifier_corr"] = statistics.correlation(scores, [float(ok) for ok in success])
    return out
