"""The tables of docs/experiments/meta-rl.md, from its committed records (``experiments/tables.py meta-rl``).

Issue 49's learning-across-episodes claim (LaMer, MR-Search) with its controls (``experiments/plans/issue49d.toml``):
SmolLM2-135M-Instruct on ``hidden_word``, one warm start recipe (half of its demos scripted trials), then per seed
meta-RL (trials of 3 attempts with trained reflections), single-episode GRPO with 3x the tasks a step, and the meta
arm's SFT-only control. Evaluations are sampled trials: 4 trials of 3 attempts per held-out task, 40 tasks a seed.
The records are ``docs/experiments/data/issue49/batch-meta/runs/NAME/`` (config, metrics and samples, gzipped) and
the batch's log.

Three figures per task, from an evaluation row's per-task outcomes:

- ``attempt 1``: the share of the task's 4 trials whose first attempt succeeded (``task_success``);
- ``by attempt 3``: the share solved within 3 sequential attempts, each after the feedback and reflection of the
  ones before (``task_success_by_attempt[2]``);
- ``pass@3``: the unbiased pass@3 of the task's 4 *independent* first attempts (``ctxrl.meta.stats.pass_at_k``
  with n = 4 and c = 4 x attempt 1): what three tries without feedback give.

LaMer's claim is that meta-RL's sequential attempts beat independent ones: meta's ``by attempt 3`` against
single-episode RL's ``pass@3``. RL's own share is meta against its SFT-only control. Intervals are
``experiments/stats.py``'s two-level bootstrap over seeds and held-out tasks (paired by task within a seed's draw);
the paired t-test is over the seed differences.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_rl import _metric_rows, arm_runs  # noqa: E402  (sibling scripts, not a package)
from stats import SeedOutcome, bootstrap_difference, bootstrap_mean, paired_t_test, seed_differences  # noqa: E402

from ctxrl.meta.stats import pass_at_k  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "data" / "issue49" / "batch-meta"
PREFIX = "hw135-b2-s"
ARMS = {"meta": "meta-RL (3 attempts, reflections)", "single3x": "single-episode RL, 3x tasks a step",
        "meta-sftonly": "meta's SFT-only control"}
"""The plan's arms (run name after ``hw135-b2-sN-``) -> label, in the page's order."""
SEEDS = 5
STEPS = (0, 20, 40, 60, 80, 100)
TRIALS = 4
"""Sampled trials per held-out task in every evaluation (``meta.eval_trials``)."""
K = 3
FIGURES = ("attempt 1", "by attempt 3", "pass@3")


def runs(data: Path = DATA) -> dict[str, list[tuple[int, Path]]]:
    """Label -> [(seed, run directory)], seeds in order; arms with no runs are left out (``arm_runs``)."""
    return arm_runs(data / "runs", PREFIX, ARMS)


def task_figures(row: dict) -> dict[str, dict[str, float]]:
    """Figure name -> task id -> value, from one evaluation row (the module docstring)."""
    first = row["task_success"]
    by_attempt = row["task_success_by_attempt"]
    return {"attempt 1": dict(first),
            "by attempt 3": {t: v[K - 1] for t, v in by_attempt.items()},
            "pass@3": {t: pass_at_k(TRIALS, round(p * TRIALS), K) for t, p in first.items()}}


def _eval_row(run_dir: Path, step: int) -> dict | None:
    return next((r for r in _metric_rows(run_dir)
                 if r.get("phase") == "eval" and r.get("split") == "heldout" and r.get("step") == step), None)


def outcomes(arm: list[tuple[int, Path]], step: int, figure: str, *, every_seed: bool = True) -> list[SeedOutcome]:
    """Per seed: ``figure`` at ``step`` with its per-task values and its draw (``eval.seed`` = 100 + seed); [] unless
    every seed has it (``every_seed``), else the seeds that do."""
    out = []
    for seed, run_dir in arm:
        row = _eval_row(run_dir, step)
        if row is None:
            if every_seed:
                return []
            continue
        tasks = task_figures(row)[figure]
        out.append(SeedOutcome(statistics.fmean(tasks.values()), tasks, 100 + seed))
    return out


def gain_outcomes(arm: list[tuple[int, Path]], step: int) -> list[SeedOutcome]:
    """Per seed: what attempts 2-3 add, ``by attempt 3`` − ``attempt 1`` per task, at ``step``; [] unless every
    seed has it."""
    out = []
    for seed, run_dir in arm:
        row = _eval_row(run_dir, step)
        if row is None:
            return []
        f = task_figures(row)
        tasks = {t: f["by attempt 3"][t] - f["attempt 1"][t] for t in f["attempt 1"]}
        out.append(SeedOutcome(statistics.fmean(tasks.values()), tasks, 100 + seed))
    return out


def common_step(data: Path = DATA) -> int:
    """The last evaluation every seed of every arm reached: where the arms are compared."""
    arms = runs(data)
    reached = [s for s in STEPS if all(len(outcomes(arm, s, "attempt 1")) == SEEDS for arm in arms.values())]
    return max(reached)


def status(data: Path = DATA) -> str:
    """How far each arm's runs got (from their logs and metrics), and the step the arms are compared at."""
    arms = runs(data)
    lines = []
    for label, arm in arms.items():
        steps = []
        for _, run_dir in arm:
            rows = [r for r in _metric_rows(run_dir) if r.get("phase") in ("rl", "sft_control")]
            steps.append(max((r["step"] for r in rows), default=0))
        stopped = sum("SIGTERM" in (run_dir / "log.txt").read_text() for _, run_dir in arm)
        lines.append(f"- {label}: {len(arm)} seeds; RL steps reached {', '.join(map(str, steps))}"
                     + (f" ({stopped} stopped by the batch's deadline)" if stopped else " (every run finished)"))
    step = common_step(data)
    lines.append(f"\nEvery seed of every arm has its evaluation at step {step}: the arms are compared there.")
    return "\n".join(lines)


def _cell(found: list[SeedOutcome], *, interval: bool) -> str:
    if not found:
        return "–"
    iv = bootstrap_mean(found)
    n = "" if len(found) == SEEDS else f" (n={len(found)})"
    if interval:
        return f"{iv.mean:.2f} [{iv.low:.2f}, {iv.high:.2f}]{n}"
    return f"{iv.mean:.2f}{n}"


def curve_table(data: Path = DATA) -> str:
    """Per arm and figure, the mean over seeds at each evaluation; [95%] at step 0 and the common step; seeds that
    reached a later step are counted (n)."""
    arms, step = runs(data), common_step(data)
    lines = ["| arm | figure | " + " | ".join(f"step {s}" for s in STEPS) + " |",
             "|---|---|" + "---|" * len(STEPS)]
    for label, arm in arms.items():
        for figure in FIGURES:
            cells = [_cell(outcomes(arm, s, figure, every_seed=False), interval=s in (0, step)) for s in STEPS]
            lines.append(f"| {label} | {figure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def contrasts(data: Path = DATA) -> list[tuple[str, list[SeedOutcome], list[SeedOutcome]]]:
    """(question, arm's outcomes, baseline's) at the common step, in the page's order."""
    arms, step = runs(data), common_step(data)
    meta, single, control = (arms[ARMS[k]] for k in ("meta", "single3x", "meta-sftonly"))
    return [
        ("meta by attempt 3 − single-episode RL's pass@3 (LaMer's comparison)",
         outcomes(meta, step, "by attempt 3"), outcomes(single, step, "pass@3")),
        ("meta by attempt 3 − single-episode RL by attempt 3 (both with reflections)",
         outcomes(meta, step, "by attempt 3"), outcomes(single, step, "by attempt 3")),
        ("meta by attempt 3 − its SFT-only control (RL's share)",
         outcomes(meta, step, "by attempt 3"), outcomes(control, step, "by attempt 3")),
        ("meta by attempt 3 − its warm start (step 0)",
         outcomes(meta, step, "by attempt 3"), outcomes(meta, 0, "by attempt 3")),
        ("what attempts 2-3 add: meta − single-episode RL", gain_outcomes(meta, step), gain_outcomes(single, step)),
        ("what attempts 2-3 add: meta − its SFT-only control", gain_outcomes(meta, step), gain_outcomes(control, step)),
        ("meta attempt 1 − single-episode RL attempt 1", outcomes(meta, step, "attempt 1"),
         outcomes(single, step, "attempt 1")),
    ]


def contrast_table(data: Path = DATA) -> str:
    """Each contrast at the common step, paired by seed and task: mean [95%], seeds × tasks, the paired t-test."""
    lines = ["| contrast | difference [95%] | seeds × tasks | paired t (df), p |", "|---|---|---|---|"]
    for question, a, b in contrasts(data):
        if not a or len(a) != len(b):
            lines.append(f"| {question} | – | – | – |")
            continue
        iv = bootstrap_difference(a, b)
        t, df, p = paired_t_test(seed_differences(a, b))
        lines.append(f"| {question} | {iv.mean:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}] | {iv.n_seeds} × {iv.n_tasks} "
                     f"| {t:.2f} ({df}), {p:.3f} |")
    return "\n".join(lines)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def work_table(data: Path = DATA) -> str:
    """What each arm played and spent per step (the mean over its runs of each run's mean over its steps): trials or
    episodes trained, attempts per trial, attempts (episodes) played, seconds per step (many runs shared one card)."""
    lines = ["| arm | trained trials or episodes / step | attempts / trial | attempts played / step | s / step |",
             "|---|---|---|---|---|"]
    for label, arm in runs(data).items():
        per_run = []
        for _, run_dir in arm:
            rows = [r for r in _metric_rows(run_dir) if r.get("phase") in ("rl", "sft_control")]
            trained = _mean([r["trained_episodes"] for r in rows if "trained_episodes" in r])
            attempts = _mean([r["attempts"] for r in rows if r.get("attempts") is not None])
            seconds = _mean([r["time_step"] for r in rows if "time_step" in r])
            per_run.append((trained, attempts, seconds))
        trained, attempts, seconds = (_mean([x[i] for x in per_run if x[i] is not None]) for i in range(3))
        played = None if trained is None else trained * (attempts or 1.0)
        fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
        lines.append(f"| {label} | {fmt(trained, '.0f')} | {fmt(attempts, '.2f')} | {fmt(played, '.0f')} "
                     f"| {fmt(seconds, '.1f')} |")
    return "\n".join(lines)


def page_tables(data: Path = DATA) -> dict[str, str]:
    """The page's generated blocks, by name."""
    return {"meta-rl-status": status(data), "meta-rl-curve": curve_table(data),
            "meta-rl-contrast": contrast_table(data), "meta-rl-work": work_table(data)}
