"""The tables of docs/experiments/offpolicy.md, from its committed records (``experiments/tables.py offpolicy``).

Issue 52's off-policy corrections on a real model (``experiments/plans/issue52.toml``): SmolLM2-135M-Instruct on
``calculator``, bf16, the preset's warm start, 20 GRPO steps with the decoupled objective in every arm; staleness
2 reproduced in one process (``distributed.max_staleness = 2`` without Ray), each correction against none and
against on-policy training, 5 seeds. The records are ``docs/experiments/data/issue52/batch/runs/NAME/`` (each run's
config, metrics and samples, gzipped, as ``experiments/batch.py pack`` leaves them) and the batch's log.

Intervals are ``experiments/stats.py``'s two-level bootstrap over seeds and held-out tasks; the paired t-test is
over the seed differences.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_rl import _metric_rows, arm_runs  # noqa: E402  (sibling scripts, not a package)
from stats import SeedOutcome, bootstrap_difference, bootstrap_mean, paired_t_test, seed_differences  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "data" / "issue52"
PREFIX = "ca135-b0-s"
ARMS = {"onpolicy": "on-policy (staleness 0)", "stale2": "staleness 2, no correction",
        **{f"stale2-{name}": f"staleness 2, {name}" for name in
           ("token_tis", "sequence_tis", "sequence_mis", "geometric_mis", "icepop", "m2po")}}
"""The plan's arms (run name after ``ca135-b0-sN-``) -> label, in the page's order."""
SEEDS = 5
STEPS = (0, 5, 10, 15, 20)
INTERVAL_STEPS = (0, 10, 20)
"""The evaluations whose cells carry a 95% interval (the others their mean)."""
LAGGED_FROM = 2
"""RL rows after this step (rows count from 1) are the ones whose episodes are two versions old: the first two
steps play version 0 at ages 0 and 1."""


def runs(data: Path = DATA) -> dict[str, list[tuple[int, Path]]]:
    """Label -> [(seed, run directory)], seeds in order; arms with no runs are left out (``arm_runs``)."""
    return arm_runs(data / "batch" / "runs", PREFIX, ARMS)


def outcomes(arm: list[tuple[int, Path]], step: int) -> list[SeedOutcome]:
    """Per seed: held-out success at ``step`` with its per-task outcomes and its draw; [] unless every seed has it."""
    out = []
    for seed, run_dir in arm:
        row = next((r for r in _metric_rows(run_dir)
                    if r.get("phase") == "eval" and r.get("split") == "heldout" and r.get("step") == step), None)
        if row is None:
            return []
        out.append(SeedOutcome(row["success"], row.get("task_success"), 1000 + seed))
    return out


def _cell(found: list[SeedOutcome], step: int) -> str:
    if not found:
        return "–"
    iv = bootstrap_mean(found)
    if step in INTERVAL_STEPS:
        return f"{iv.mean:.2f} [{iv.low:.2f}, {iv.high:.2f}]"
    return f"{iv.mean:.2f}"


def curve_table(data: Path = DATA) -> str:
    """Held-out success (greedy, 60 tasks) per arm at each evaluation: the mean over seeds, [95%] at 0, 10, 20."""
    head = " | ".join(f"step {s}" for s in STEPS)
    lines = [f"| arm | runs | {head} |", "|---|---|" + "---|" * len(STEPS)]
    for label, arm in runs(data).items():
        lines.append(f"| {label} | {len(arm)} | " + " | ".join(_cell(outcomes(arm, s), s) for s in STEPS) + " |")
    return "\n".join(lines)


def contrast_table(data: Path = DATA, step: int = 20) -> str:
    """Each staleness-2 arm at ``step`` against no correction and against on-policy training, paired by seed and
    task: mean [95%] and the paired t-test over the seed differences."""
    arms = runs(data)
    baselines = [label for label in (ARMS["stale2"], ARMS["onpolicy"]) if label in arms]
    lines = ["| arm | against | difference [95%] | seeds × tasks | paired t (df), p |", "|---|---|---|---|---|"]
    for label, arm in arms.items():
        for baseline in baselines:
            if baseline == label or label == ARMS["onpolicy"]:
                continue
            a, b = outcomes(arm, step), outcomes(arms[baseline], step)
            if not a or len(a) != len(b):
                continue
            iv = bootstrap_difference(a, b)
            t, df, p = paired_t_test(seed_differences(a, b))
            lines.append(f"| {label} | {baseline} | {iv.mean:+.2f} [{iv.low:+.2f}, {iv.high:+.2f}] | "
                         f"{iv.n_seeds} × {iv.n_tasks} | {t:.2f} ({df}), {p:.3f} |")
    return "\n".join(lines)


def _mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _changed(rows: list[dict]) -> tuple[str, float | None]:
    """What the correction changed, by its own figure: the fraction of tokens masked or clipped, or of sequences
    masked (a sequence-level rejection logs both; its sequence figure is the one it decides by)."""
    for key, label in (("offpolicy_seq_masked_frac", "sequences masked"), ("offpolicy_masked_frac", "tokens masked"),
                       ("offpolicy_clipped_frac", "clipped")):
        value = _mean_of(rows, key)
        if value is not None:
            return label, value
    return "", None


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def mismatch_table(data: Path = DATA) -> str:
    """Per arm, over the RL steps from ``LAGGED_FROM`` on (every episode two versions old in the lagged arms), the
    mean over its runs of each run's mean: staleness, the behaviour/learner gap before the update (mean |Δ log p|
    per sampled token, and its KL estimate), the correction's mean ratio and weight and what it masked or clipped,
    and the median gradient norm. (No seconds per step: the runs shared the card 4, 12 or 16 at a time.)"""
    lines = ["| arm | staleness | mean abs Δ log p | KL (behaviour ‖ learner) | ratio mean | weight mean | "
             "masked or clipped | grad norm (median) |", "|---|---|---|---|---|---|---|---|"]
    for label, arm in runs(data).items():
        per_run = [rows for _, d in arm if (rows := _late_rows([(0, d)]))]
        if not per_run:
            continue

        def mean(key: str, runs_rows=per_run) -> float | None:
            values = [v for v in (_mean_of(rows, key) for rows in runs_rows) if v is not None]
            return sum(values) / len(values) if values else None

        changed = [_changed(rows) for rows in per_run]
        what = changed[0][0]
        frac = [v for _, v in changed if v is not None]
        grads = [r["grad_norm"] for rows in per_run for r in rows if r.get("grad_norm") is not None]
        staleness = mean("staleness_mean")
        staleness = 0.0 if staleness is None and label == ARMS["onpolicy"] else staleness  # (0: not logged)
        lines.append(f"| {label} | {_fmt(staleness, '.2f')} | "
                     f"{_fmt(mean('mismatch_abs_before_update'), '.4f')} | "
                     f"{_fmt(mean('mismatch_kl_before_update'), '.5f')} | "
                     f"{_fmt(mean('offpolicy_ratio_mean'), '.3f')} | "
                     f"{_fmt(mean('offpolicy_weight_mean'), '.3f')} | "
                     + (f"{sum(frac) / len(frac):.3f} {what}" if frac else "–") + " | "
                     f"{_fmt(statistics.median(grads) if grads else None, '.3f')} |")
    return "\n".join(lines)


def status(data: Path = DATA) -> str:
    """How many runs of each arm reached their last evaluation (step 20), in a sentence."""
    arms = runs(data)
    done = {label: sum(1 for _, d in arm if any(r.get("phase") == "eval" and r.get("split") == "heldout"
                                                and r.get("step") == STEPS[-1] for r in _metric_rows(d)))
            for label, arm in arms.items()}
    total = sum(done.values())
    planned = SEEDS * len(ARMS)
    missing = [f"{label} ({n} of {SEEDS})" for label, n in done.items() if n < SEEDS]
    missing += [f"{label} (0 of {SEEDS})" for label in ARMS.values() if label not in arms]
    return (f"{total} of the plan's {planned} runs reached their step-{STEPS[-1]} evaluation"
            + (f"; short: {', '.join(missing)}." if missing else f": every arm finished, {SEEDS} seeds each."))


COLLAPSE_FROM, COLLAPSE_BELOW = 0.9, 0.5
"""A run collapsed when its training success fell below ``COLLAPSE_BELOW`` after it had reached ``COLLAPSE_FROM``."""


def collapsed(rows: list[dict]) -> int | None:
    """The first RL step (as logged, from 1) at which the run's training success fell below ``COLLAPSE_BELOW``
    after having reached ``COLLAPSE_FROM``; None if it never did."""
    reached = False
    for r in rows:
        if r.get("phase") != "rl":
            continue
        reached = reached or r["success"] >= COLLAPSE_FROM
        if reached and r["success"] < COLLAPSE_BELOW:
            return r["step"]
    return None


def fisher_exact(a: int, n: int, b: int, m: int) -> float:
    """Two-sided Fisher exact p of ``a`` of ``n`` against ``b`` of ``m``: the probability, given the margins, of a
    split at most as likely as the one seen."""
    total, hits = n + m, a + b

    def p(k: int) -> float:
        return math.comb(n, k) * math.comb(m, hits - k) / math.comb(total, hits)

    seen = p(a)
    return min(1.0, sum(p(k) for k in range(max(0, hits - m), min(n, hits) + 1) if p(k) <= seen * (1 + 1e-9)))


def collapse_counts(arms: dict[str, list[tuple[int, Path]]]) -> dict[str, int]:
    """Per arm, how many of its runs collapsed (``collapsed``)."""
    return {label: sum(collapsed(_metric_rows(d)) is not None for _, d in arm) for label, arm in arms.items()}


def stability_table(data: Path = DATA) -> str:
    """Per arm: the runs whose training success collapsed (fell below 0.5 after reaching 0.9) and at which step,
    with the Fisher exact p of that count against the uncorrected arm's; the lowest training success after step 5
    (mean over runs), and held-out success per seed at step 10."""
    lines = ["| arm | runs that collapsed (step) | against no correction, Fisher exact p | lowest training success "
             "after step 5, mean over runs | held-out at step 10, per seed |", "|---|---|---|---|---|"]
    arms = runs(data)
    counts = collapse_counts(arms)
    base = ARMS["stale2"]
    for label, arm in arms.items():
        where, lows, held = [], [], []
        for seed, run_dir in arm:
            rows = _metric_rows(run_dir)
            step = collapsed(rows)
            if step is not None:
                where.append(f"s{seed} ({step})")
            late = [r["success"] for r in rows if r.get("phase") == "rl" and r["step"] > 5]
            lows.append(min(late) if late else float("nan"))
            row = next((r for r in rows if r.get("phase") == "eval" and r.get("split") == "heldout"
                        and r.get("step") == 10), None)
            held.append("–" if row is None else f"{row['success']:.2f}")
        fisher = ("–" if label == base or base not in arms else
                  f"{fisher_exact(counts[label], len(arm), counts[base], len(arms[base])):.3f}")
        lines.append(f"| {label} | {len(where)} of {len(arm)}" + (f": {', '.join(where)}" if where else "") +
                     f" | {fisher} | {sum(lows) / len(lows):.2f} | {' / '.join(held)} |")
    return "\n".join(lines)


def findings(data: Path = DATA) -> str:
    """The page's reading of its tables, each figure computed here from the records (nothing typed by hand)."""
    arms = runs(data)
    none, on = ARMS["stale2"], ARMS["onpolicy"]
    count = collapse_counts(arms)
    n = {label: len(arm) for label, arm in arms.items()}
    a, b = outcomes(arms[none], 10), outcomes(arms[on], 10)
    drop = bootstrap_difference(b, a)
    t, df, p = paired_t_test(seed_differences(a, b))

    def late(label: str, key: str) -> float | None:
        means = [_mean_of(_late_rows([(0, d)]), key) for _, d in arms[label]]
        means = [m for m in means if m is not None]
        return sum(means) / len(means) if means else None

    last = [[r for r in _metric_rows(d) if r.get("phase") == "rl"] for _, d in arms[none]]
    still = sum(1 for rows in last if rows and rows[-1]["success"] < COLLAPSE_BELOW)
    held = [label for label in arms if label not in (none, on) and count[label] == 0]
    worse = [label for label in arms if label not in (none, on) and count[label] > 0]
    kl = {label: late(label, "mismatch_kl_before_update") for label in arms if label not in (on,)}
    others = [v for label, v in kl.items() if label != none and v is not None]
    geo = ARMS["stale2-geometric_mis"]
    five = {label: bootstrap_mean(outcomes(arms[label], 5)).mean for label in (geo, on) if label in arms}
    lines = [
        f"- **Staleness 2 without a correction broke training on this task**: {count[none]} of {n[none]} runs "
        f"collapsed, against {count[on]} of {n[on]} on-policy runs (Fisher exact p = "
        f"{fisher_exact(count[none], n[none], count[on], n[on]):.3f}). Held-out success at step 10 fell by "
        f"{drop.mean:.2f} [{drop.low:.2f}, {drop.high:.2f}] (paired t p = {p:.3f}, {df} degrees of freedom; the "
        "interval is over seeds and tasks, the test over seeds alone). By step 20 its held-out (greedy) success was "
        f"back with on-policy training's, so a final figure alone does not show it; {still} of {n[none]} runs still "
        "sampled below 0.5 success at their last step.",
        f"- **{', '.join(label.removeprefix('staleness 2, ') for label in held)} prevented it**: none of their runs "
        "collapsed, and at steps 10 and 20 each is within the intervals of on-policy training (the tables above). "
        "What each changed to do so is in its own figure: "
        + "; ".join(f"{label.removeprefix('staleness 2, ')} {_changed(_late_rows(arms[label]))[1]:.3f} "
                    f"{_changed(_late_rows(arms[label]))[0]}" for label in held) + ".",
        f"- **{' and '.join(label.removeprefix('staleness 2, ') for label in worse)} helped less**: "
        + "; ".join(f"{label.removeprefix('staleness 2, ')} {count[label]} of {n[label]} collapsed" for label in worse)
        + f". Geometric MIS at its default bounds rejected {_changed(_late_rows(arms[geo]))[1]:.0%} of the "
        f"sequences and learned more slowly (held-out {five[geo]:.2f} at step 5 against {five[on]:.2f} "
        "on-policy).",
        f"- The behaviour/learner gap is larger in the uncorrected arm (KL {kl[none]:.4f} against "
        f"{min(others):.4f}–{max(others):.4f}) because its policy moved more, not because its episodes were older: "
        "every staleness-2 arm played episodes exactly two versions old.",
    ]
    return "\n".join(lines)


def _late_rows(arm: list[tuple[int, Path]]) -> list[dict]:
    """Every run's RL rows after ``LAGGED_FROM``, together."""
    return [r for _, d in arm for r in _metric_rows(d) if r.get("phase") == "rl" and r.get("step", 0) > LAGGED_FROM]


def page_tables(data: Path = DATA) -> dict[str, str]:
    return {"offpolicy-status": status(data), "offpolicy-curve": curve_table(data),
            "offpolicy-stability": stability_table(data), "offpolicy-contrast-10": contrast_table(data, 10),
            "offpolicy-contrast": contrast_table(data), "offpolicy-mismatch": mismatch_table(data),
            "offpolicy-findings": findings(data)}
