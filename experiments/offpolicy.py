"""The tables of docs/experiments/offpolicy.md, from its committed records (``experiments/tables.py offpolicy``).

Issue 52's off-policy corrections on a real model (``experiments/plans/issue52.toml``): SmolLM2-135M-Instruct on
``calculator``, bf16, the preset's warm start, 20 GRPO steps with the decoupled objective in every arm; staleness
2 reproduced in one process (``distributed.max_staleness = 2`` without Ray), each correction against none and
against on-policy training, 3 seeds. The records are ``docs/experiments/data/issue52/batch/runs/NAME/`` (each run's
config, metrics and samples, gzipped, as ``experiments/batch.py pack`` leaves them) and the batch's log.

Intervals are ``experiments/stats.py``'s two-level bootstrap over seeds and held-out tasks; the paired t-test is
over the seed differences. Three seeds are a pilot.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_rl import _metric_rows  # noqa: E402  (sibling scripts, not a package)
from stats import SeedOutcome, bootstrap_difference, bootstrap_mean, paired_t_test, seed_differences  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "data" / "issue52"
PREFIX = "ca135-b0-s"
ARMS = {"onpolicy": "on-policy (staleness 0)", "stale2": "staleness 2, no correction",
        **{f"stale2-{name}": f"staleness 2, {name}" for name in
           ("token_tis", "sequence_tis", "sequence_mis", "geometric_mis", "icepop", "m2po")}}
"""The plan's arms (run name after ``ca135-b0-sN-``) -> label, in the page's order."""
STEPS = (0, 5, 10, 15, 20)
INTERVAL_STEPS = (0, 10, 20)
"""The evaluations whose cells carry a 95% interval (the others their mean)."""
LAGGED_FROM = 2
"""RL rows after this step (rows count from 1) are the ones whose episodes are two versions old: the first two
steps play version 0 at ages 0 and 1."""


def runs(data: Path = DATA) -> dict[str, list[tuple[int, Path]]]:
    """Label -> [(seed, run directory)], seeds in order; arms with no runs are left out."""
    out: dict[str, list[tuple[int, Path]]] = {}
    root = data / "batch" / "runs"
    for run_dir in sorted(root.iterdir()) if root.is_dir() else ():
        if not run_dir.name.startswith(PREFIX):
            continue
        seed, arm = run_dir.name.removeprefix(PREFIX).split("-", 1)
        if arm in ARMS:
            out.setdefault(ARMS[arm], []).append((int(seed), run_dir))
    return {label: sorted(out[label]) for label in ARMS.values() if label in out}


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
    the median gradient norm and seconds per step."""
    lines = ["| arm | staleness | mean abs Δ log p | KL (behaviour ‖ learner) | ratio mean | weight mean | "
             "masked or clipped | grad norm (median) | s / step (median) |", "|---|---|---|---|---|---|---|---|---|"]
    for label, arm in runs(data).items():
        per_run = [[r for r in _metric_rows(d) if r.get("phase") == "rl" and r.get("step", 0) > LAGGED_FROM]
                   for _, d in arm]
        per_run = [rows for rows in per_run if rows]
        if not per_run:
            continue

        def mean(key: str, runs_rows=per_run) -> float | None:
            values = [v for v in (_mean_of(rows, key) for rows in runs_rows) if v is not None]
            return sum(values) / len(values) if values else None

        changed = [_changed(rows) for rows in per_run]
        what = changed[0][0]
        frac = [v for _, v in changed if v is not None]
        grads = [r["grad_norm"] for rows in per_run for r in rows if r.get("grad_norm") is not None]
        seconds = [r["time_step"] for rows in per_run for r in rows if r.get("time_step") is not None]
        lines.append(f"| {label} | {_fmt(mean('staleness_mean'), '.2f')} | "
                     f"{_fmt(mean('mismatch_abs_before_update'), '.4f')} | "
                     f"{_fmt(mean('mismatch_kl_before_update'), '.5f')} | "
                     f"{_fmt(mean('offpolicy_ratio_mean'), '.3f')} | "
                     f"{_fmt(mean('offpolicy_weight_mean'), '.3f')} | "
                     + (f"{sum(frac) / len(frac):.3f} {what}" if frac else "–") + " | "
                     f"{_fmt(statistics.median(grads) if grads else None, '.3f')} | "
                     f"{_fmt(statistics.median(seconds) if seconds else None, '.1f')} |")
    return "\n".join(lines)


def status(data: Path = DATA) -> str:
    """How many runs of each arm reached their last evaluation (step 20), in a sentence."""
    arms = runs(data)
    done = {label: sum(1 for _, d in arm if any(r.get("phase") == "eval" and r.get("split") == "heldout"
                                                and r.get("step") == STEPS[-1] for r in _metric_rows(d)))
            for label, arm in arms.items()}
    total = sum(done.values())
    planned = 3 * len(ARMS)
    missing = [f"{label} ({n} of 3)" for label, n in done.items() if n < 3]
    missing += [f"{label} (0 of 3)" for label in ARMS.values() if label not in arms]
    return (f"{total} of the plan's {planned} runs reached their step-{STEPS[-1]} evaluation"
            + (f"; short: {', '.join(missing)}." if missing else ": every arm finished, 3 seeds each."))


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


def stability_table(data: Path = DATA) -> str:
    """Per arm: the runs whose training success collapsed (fell below 0.5 after reaching 0.9) and at which step,
    the lowest training success after step 5 (mean over runs), and held-out success per seed at step 10."""
    lines = ["| arm | runs that collapsed (step) | lowest training success after step 5, mean over runs | "
             "held-out at step 10, per seed |", "|---|---|---|---|"]
    for label, arm in runs(data).items():
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
        lines.append(f"| {label} | {len(where)} of {len(arm)}" + (f": {', '.join(where)}" if where else "") +
                     f" | {sum(lows) / len(lows):.2f} | {' / '.join(held)} |")
    return "\n".join(lines)


def page_tables(data: Path = DATA) -> dict[str, str]:
    return {"offpolicy-status": status(data), "offpolicy-curve": curve_table(data),
            "offpolicy-stability": stability_table(data), "offpolicy-contrast-10": contrast_table(data, 10),
            "offpolicy-contrast": contrast_table(data), "offpolicy-mismatch": mismatch_table(data)}
