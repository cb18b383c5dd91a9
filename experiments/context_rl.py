"""The tables of docs/experiments/context-rl.md, from its committed records (``experiments/tables.py context-rl``).

Issue 49's context experiment: ``fact_hunt`` on SmolLM2-135M-Instruct, policy-written summaries after a format-only
warm start, their SFT-only control and a window matched on peak context (``experiments/plans/issue49.toml``). The
records are ``docs/experiments/data/issue49/``:

- ``runs.json``: ``experiments/tables.py collect`` of ``batch/`` (each run's config, metrics and samples, gzipped);
- ``ceilings-fact_hunt.json``: ``experiments/ceilings.py``, the managers' scripted ceilings by budget;
- ``evals/``: the summarising runs' final checkpoints evaluated with more summaries allowed (``ctxrl eval`` with
  ``context.eval_max_summaries``, now ``context.summarize.eval_max_summaries``), on held-out and on OOD trails.

``trail_lengths`` rebuilds each held-out task from its seed (the environment is deterministic; the ids are checked)
to say on which trails the successes fell. Intervals are ``experiments/stats.py``'s two-level bootstrap over seeds
and held-out tasks.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import SeedOutcome, bootstrap_mean  # noqa: E402  (a sibling script, not a package)

DATA = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "data" / "issue49"
ARMS = {("summarize", "fmt", "rl"): "summarize 384, RL", ("summarize", "fmt-sftonly", "sft"): "summarize 384, SFT-only",
        ("window", "d300", "rl"): "window 456, RL"}
"""The arms of the page, in its order: (arm, variant, objective) -> label."""


def _cell(iv) -> str:
    return f"{iv.mean:.2f} [{iv.low:.2f}, {iv.high:.2f}]"


def arm_records(records: list[dict]) -> dict[str, list[dict]]:
    """The records of each arm of ``ARMS``, by label, ordered by seed."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r["seed"]):
        label = ARMS.get((r.get("arm"), r.get("variant"), r.get("objective") or "rl"))
        if label:
            out[label].append(r)
    return out


def interval(runs: list[dict], field: str, tasks_field: str | None):
    """The arm's mean of ``field`` with its 95% interval over seeds (and tasks, where the records have them)."""
    return bootstrap_mean([SeedOutcome(r[field], r.get(tasks_field) if tasks_field else None) for r in runs])


def trail_lengths(eval_seed: int, ids: set[str], n: int = 60) -> dict[str, list[int]]:
    """Task id -> the pages of each held-out task behind it, for the ``n`` tasks of ``eval.seed = eval_seed``.

    ``ids`` are a record's: the runs of issue 49 were evaluated before task ids hashed a task's hidden data, when
    two trails from one first page shared an id (and an evaluation merged their outcomes); their ids are matched
    the old way, by the prompt alone, so one id may stand for two trails."""
    from ctxrl.envs.fact_hunt import FactHuntEnv
    from ctxrl.tasks.space import task_id

    tasks = FactHuntEnv.sample_tasks("heldout", n, eval_seed)
    by_id: dict[str, list[int]] = defaultdict(list)
    legacy = not ids <= {t.id for t in tasks}
    for t in tasks:
        by_id[task_id(FactHuntEnv.name, t.prompt) if legacy else t.id].append(len(t.data["trail"]))
    if not ids <= set(by_id):
        raise ValueError(f"task ids {sorted(ids - set(by_id))[:3]} are not held-out tasks of eval.seed {eval_seed}")
    return dict(by_id)


def successes_by_trail(runs: list[dict]) -> tuple[int, int, int, int]:
    """Over the runs: (held-out tasks solved, of them two-page trails, of them an id shared by a two-page and a
    longer trail, where the record cannot say which was solved; two-page trails evaluated)."""
    solved = two = unclear = two_total = 0
    for r in runs:
        tasks = r["heldout_tasks_after"]
        pages = trail_lengths(1000 + r["seed"], set(tasks))
        two_total += sum(p.count(2) for p in pages.values())
        for task, value in tasks.items():
            if value <= 0:
                continue
            solved += 1
            two += set(pages[task]) == {2}
            unclear += 2 in pages[task] and set(pages[task]) != {2}
    return solved, two, unclear, two_total


def arms_table(records: list[dict]) -> str:
    """Per arm: held-out success after the warm start and after 100 steps, what summaries kept, summaries per
    episode and peak working context after, and where the successes fell."""
    lines = ["| arm | runs | held-out after the warm start | held-out after 100 steps [95%] | answer's facts kept "
             "by summaries, before → after | summaries / episode after | peak working context after (max) | "
             "held-out successes on two-page trails |", "|---|---|---|---|---|---|---|---|"]
    for label, runs in arm_records(records).items():
        before = interval(runs, "heldout_before", "heldout_tasks_before")
        after = interval(runs, "heldout_after", "heldout_tasks_after")
        if runs[0].get("summary_retention_before") is not None:
            kept = (f"{_cell(interval(runs, 'summary_retention_before', 'summary_retention_tasks_before'))} → "
                    f"{_cell(interval(runs, 'summary_retention_after', 'summary_retention_tasks_after'))}")
        else:
            kept = "– (no summaries)"
        summaries = sum(r["summaries_per_episode_after"] or 0 for r in runs) / len(runs)
        peak = max(r["peak_context_after"] for r in runs)
        solved, two, unclear, two_total = successes_by_trail(runs)
        shared = f", {unclear} more shares its id with a longer trail" if unclear else ""
        lines.append(f"| {label} | {len(runs)} | {_cell(before)} | {_cell(after)} | {kept} | {summaries:.2f} | "
                     f"{peak:.0f} | {two} of {solved}{shared} ({two_total} two-page trails evaluated) |")
    return "\n".join(lines)


def ceilings_table(path: Path) -> str:
    """Scripted ceiling (peak working context) of each manager at each budget."""
    records = json.loads(path.read_text())
    budgets = sorted({r["budget"] for r in records if r.get("budget")})
    managers = list(dict.fromkeys(r["manager"] for r in records))
    by = {(r["manager"], r.get("budget")): r for r in records}
    lines = ["| manager | " + " | ".join(str(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for m in managers:
        if (m, None) in by:  # no budget: one figure
            r = by[(m, None)]
            lines.append(f"| {m} (no budget) | " + " | ".join(
                [f"{r['ceiling']:.2f} ({r['peak_context_max']})"] + ["" for _ in budgets[1:]]) + " |")
            continue
        cells = []
        for b in budgets:
            r = by.get((m, b))
            cells.append("–" if r is None or "error" in r else f"{r['ceiling']:.2f} ({r['peak_context_max']})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def eval_limits_table(evals: Path) -> str:
    """The summarising RL runs' final checkpoints with more summaries allowed at evaluation, per split and limit."""
    rows: dict[tuple[str, int], list[float]] = defaultdict(list)
    for metrics in sorted(evals.glob("*/metrics.jsonl")):
        name = metrics.parent.name  # fh135-b0-sS-summarize384-fmt-SPLIT-K
        *_, split, limit = name.split("-")
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if row.get("phase") == "eval" and row.get("split") == split:
                rows[(split, int(limit))].append(row["success"])
    lines = ["| split | summaries allowed | runs | success, mean (min–max over runs) |", "|---|---|---|---|"]
    for (split, limit), values in sorted(rows.items()):
        lines.append(f"| {split} | {limit} | {len(values)} | {sum(values) / len(values):.2f} "
                     f"({min(values):.2f}–{max(values):.2f}) |")
    return "\n".join(lines)


def arm_runs(root: Path, prefix: str, arms: dict[str, str]) -> dict[str, list[tuple[int, Path]]]:
    """A batch's runs by arm: ``root`` holds run directories named ``PREFIX<seed>-<arm>``; ``arms`` maps an arm's
    name to its label. Label -> [(seed, run directory)], seeds in order, in ``arms``' order; arms with no runs are
    left out, and so are runs of other arms."""
    out: dict[str, list[tuple[int, Path]]] = {}
    for run_dir in sorted(root.iterdir()) if root.is_dir() else ():
        if not run_dir.name.startswith(prefix):
            continue
        seed, arm = run_dir.name.removeprefix(prefix).split("-", 1)
        if arm in arms:
            out.setdefault(arms[arm], []).append((int(seed), run_dir))
    return {label: sorted(out[label]) for label in arms.values() if label in out}


@functools.cache
def _metric_rows(run_dir: Path) -> tuple[dict, ...]:
    """A run's metrics rows, read once: the tables ask for each run's evaluations many times (read-only)."""
    import gzip

    found = sorted(run_dir.glob("*/metrics.jsonl.gz"))
    if not found:
        return ()
    with gzip.open(found[0], "rt") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def fmt34_table(batch: Path) -> str:
    """The 3-4 page pilot (``experiments/plans/issue49b.toml``'s RL arm, ``batch-fmt34/``): per run, how far it got
    and how it ended (from its log), held-out success after the warm start and at its last evaluation, the share
    of training groups with mixed rewards (the only ones GRPO learns from), and of the answer's facts, those in
    context when the answer was written (``facts_at_answer``), on held-out tasks before and after."""
    lines = ["| run | RL steps | how it ended | held-out after the warm start → last evaluation | train, last "
             "evaluation | groups with mixed rewards, mean over steps | answer's facts in context at the answer, "
             "held-out before → last |", "|---|---|---|---|---|---|---|"]
    for run_dir in sorted(d for d in (batch / "runs").iterdir() if d.is_dir()):
        rows = _metric_rows(run_dir)
        steps = [r for r in rows if r.get("phase") == "rl"]
        held = [r for r in rows if r.get("phase") == "eval" and r.get("split") == "heldout"]
        train = [r for r in rows if r.get("phase") == "eval" and r.get("split") == "train"]
        log = (run_dir / "log.txt").read_text()
        stopped = "stopped by SIGTERM" in log
        ended = "stopped (SIGTERM)" if stopped else "finished" if held and held[-1]["step"] == 100 else "unknown"
        mixed = (sum(1 - r["zero_variance_groups"] / 8 for r in steps) / len(steps)) if steps else float("nan")
        last_train = f"{train[-1]['success']:.2f} (step {train[-1]['step']})" if len(train) > 1 else "–"
        facts = (f"{held[0]['facts_at_answer']:.2f} → {held[-1]['facts_at_answer']:.2f}" if len(held) > 1
                 else f"{held[0]['facts_at_answer']:.2f} → –")
        lines.append(f"| {run_dir.name} | {len(steps)} | {ended} | {held[0]['success']:.2f} → "
                     f"{held[-1]['success']:.2f} (step {held[-1]['step']}) | {last_train} | {mixed:.3f} | {facts} |")
    return "\n".join(lines)


OWN34 = {"summarize384-own34": "summarize 384, RL", "summarize384-own34-sftonly": "summarize 384, SFT-only",
         "full34": "full context, RL", "full34-warm": "full context, warm start only"}
"""issue49c.toml's arms (run name after ``fh135-b1-sN-``) -> label, in the page's order."""
OWN34_STEPS = (0, 20, 40, 60, 80, 100)


def _evals(run_dir: Path, split: str) -> dict[int, dict]:
    """A run's evaluations on ``split``, by step."""
    return {r["step"]: r for r in _metric_rows(run_dir) if r.get("phase") == "eval" and r.get("split") == split}


def own34_runs(data: Path = DATA) -> dict[str, list[tuple[int, Path]]]:
    """Label -> [(seed, run directory)] of issue49c's runs (``batch-own34/`` and ``batch-own34-full/``)."""
    out: dict[str, list[tuple[int, Path]]] = defaultdict(list)
    for batch in ("batch-own34", "batch-own34-full"):
        for run_dir in sorted((data / batch / "runs").iterdir()):
            seed, arm = run_dir.name.removeprefix("fh135-b1-s").split("-", 1)
            out[OWN34[arm]].append((int(seed), run_dir))
    return {label: sorted(out[label]) for label in OWN34.values() if label in out}


def _outcomes(runs: list[tuple[int, Path]], split: str, step: int, field: str = "success") -> list[SeedOutcome]:
    """Per seed: the evaluation's ``field`` at ``step``, with its per-task outcomes and the draw (eval.seed)."""
    out = []
    for seed, run_dir in runs:
        row = _evals(run_dir, split).get(step)
        if row is None or row.get(field) is None:  # (facts_at_answer: absent where no episode wrote an answer)
            return []
        out.append(SeedOutcome(row[field], row.get(f"task_{field}"), 1000 + seed))
    return out


OWN34_INTERVALS = (0, 40, 100)
"""The steps whose cells carry a 95% interval (the others their mean): the start, the widest gap, the end."""


def _seed_mean(outcomes: list[SeedOutcome]) -> float:
    """The mean over seeds of each seed's mean over its tasks (its value where it has none): ``bootstrap_mean``'s
    point estimate, without its resamples."""
    per_seed = [sum(o.tasks.values()) / len(o.tasks) if o.tasks else o.value for o in outcomes]
    return sum(per_seed) / len(per_seed)


def own34_curve_table(data: Path = DATA) -> str:
    """Held-out success of each arm at each evaluation: the mean, with its 95% interval over seeds and tasks at
    ``OWN34_INTERVALS``, and the runs it covers."""
    lines = ["| arm | runs | " + " | ".join(f"step {s}" for s in OWN34_STEPS) + " |",
             "|---|---|" + "---|" * len(OWN34_STEPS)]

    def cell(outcomes: list[SeedOutcome], step: int) -> str:
        if not outcomes:
            return "–"
        return _cell(bootstrap_mean(outcomes)) if step in OWN34_INTERVALS else f"{_seed_mean(outcomes):.2f}"

    for label, runs in own34_runs(data).items():
        cells = [cell(_outcomes(runs, "heldout", s), s) for s in OWN34_STEPS]
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def own34_contrast_table(data: Path = DATA) -> str:
    """RL − SFT-only on held-out success at each evaluation, paired by seed and task: mean [95%], the paired t-test
    and the exact sign-flip test over the 5 seed differences."""
    from stats import bootstrap_difference, paired_t_test, seed_differences, sign_flip_p

    runs = own34_runs(data)
    rl, sft = runs["summarize 384, RL"], runs["summarize 384, SFT-only"]
    lines = ["| step | RL − SFT-only [95%] | seeds × tasks | paired t (df), p | sign-flip p |", "|---|---|---|---|---|"]
    for step in OWN34_STEPS:
        a, b = _outcomes(rl, "heldout", step), _outcomes(sft, "heldout", step)
        iv = bootstrap_difference(a, b)
        differences = seed_differences(a, b)
        t, df, p = paired_t_test(differences)
        lines.append(f"| {step} | {iv.mean:+.2f} [{iv.low:+.2f}, {iv.high:+.2f}] | {iv.n_seeds} × {iv.n_tasks} | "
                     f"{t:.2f} ({df}), {p:.3f} | {sign_flip_p(differences):.3f} |")
    return "\n".join(lines)


def own34_content_table(data: Path = DATA) -> str:
    """Per arm, after the warm start → at step 100 (held-out): the answer's facts in context when the answer is
    written, the facts a rewrite keeps, summaries per episode and their length; OOD success at step 100; seconds
    per training step (median over the runs' steps)."""
    lines = ["| arm | answer's facts in context at the answer | facts a rewrite keeps | summaries / episode | "
             "summary tokens | OOD success, step 100 | s / step (median) |", "|---|---|---|---|---|---|---|"]
    for label, runs in own34_runs(data).items():
        if label.endswith("warm start only"):
            continue

        def span(field: str, runs=runs) -> str:
            ends = [_outcomes(runs, "heldout", s, field) for s in (0, 100)]
            return " → ".join(f"{_seed_mean(o):.2f}" if o else "– (no answer)" for o in ends)

        def mean(field: str, step: int, runs=runs) -> float:
            return sum(_evals(d, "heldout")[step][field] for _, d in runs) / len(runs)
        kept = span("fact_survival") if label.startswith("summarize") else "– (no rewrites)"
        summaries = (f"{mean('summaries_per_episode', 0):.2f} → {mean('summaries_per_episode', 100):.2f}"
                     if label.startswith("summarize") else "–")
        tokens = (f"{mean('summary_tokens_mean', 0):.0f} → {mean('summary_tokens_mean', 100):.0f}"
                  if label.startswith("summarize") else "–")
        ood = bootstrap_mean(_outcomes(runs, "ood", 100))
        steps = sorted(r["time_step"] for _, d in runs for r in _metric_rows(d)
                       if r.get("phase") in ("rl", "sft_control") and "time_step" in r)
        lines.append(f"| {label} | {span('facts_at_answer')} | {kept} | {summaries} | {tokens} | {_cell(ood)} | "
                     f"{steps[len(steps) // 2]:.1f} |")
    return "\n".join(lines)


def own34_stopping_table(data: Path = DATA) -> str:
    """How the held-out episodes ended, after the warm start → at step 100 (means over each arm's runs): tool calls
    per episode and the shares cut at the turn limit and at the context limit; and on OOD trails at step 100, of the
    answer's facts those in context at the answer."""
    lines = ["| arm | tool calls / episode | cut at the turn limit | cut at the context limit | OOD: answer's facts in "
             "context at the answer, step 100 |", "|---|---|---|---|---|"]
    for label, runs in own34_runs(data).items():
        if label.endswith("warm start only"):
            continue

        def mean(field: str, step: int, split: str = "heldout", runs=runs) -> float | None:
            """(a row leaves out a truncation no episode met, and facts_at_answer where no episode answered)"""
            default = 0.0 if field.startswith("truncated_") else None
            values = [_evals(d, split)[step].get(field, default) for _, d in runs]
            return None if any(v is None for v in values) else sum(values) / len(values)

        def span(field: str) -> str:
            return " → ".join(f"{mean(field, s):.2f}" for s in (0, 100))

        ood = mean("facts_at_answer", 100, "ood")
        lines.append(f"| {label} | {span('tool_calls')} | {span('truncated_max_turns')} | "
                     f"{span('truncated_max_context')} | {'– (no answer)' if ood is None else f'{ood:.2f}'} |")
    return "\n".join(lines)


def own34_calibration_table(data: Path = DATA) -> str:
    """issue49c-cal.toml: the warm start's size against its held-out, train and OOD success at step 0 (seed 0)."""
    lines = ["| own summarize demos | held-out | train | OOD |", "|---|---|---|---|"]
    runs = sorted((data / "calibration-own34" / "runs").iterdir(), key=lambda d: int(d.name.rsplit("-cal", 1)[1]))
    for run_dir in runs:
        cells = [f"{_evals(run_dir, split)[0]['success']:.2f}" for split in ("heldout", "train", "ood")]
        lines.append(f"| {run_dir.name.rsplit('-cal', 1)[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def page_tables(data: Path = DATA) -> dict[str, str]:
    """Every generated table of the page, by the name of the block that holds it."""
    records = json.loads((data / "runs.json").read_text())
    return {"arms": arms_table(records), "ceilings": ceilings_table(data / "ceilings-fact_hunt.json"),
            "limits": eval_limits_table(data / "evals"), "fmt34": fmt34_table(data / "batch-fmt34"),
            "own34-calibration": own34_calibration_table(data), "own34-curve": own34_curve_table(data),
            "own34-contrast": own34_contrast_table(data), "own34-content": own34_content_table(data),
            "own34-stopping": own34_stopping_table(data)}


def fill_page(text: str, tables: dict[str, str]) -> str:
    """``text`` with each block ``<!-- NAME -->`` ... ``<!-- /NAME -->`` holding ``tables[NAME]``; a block the page
    lacks is an error, so that no table is silently left out."""
    for name, table in tables.items():
        begin, end = f"<!-- {name} -->\n", f"<!-- /{name} -->"
        if begin not in text or end not in text.split(begin, 1)[-1]:
            raise ValueError(f"the page has no block {begin.strip()} ... {end}")
        head, rest = text.split(begin, 1)
        text = head + begin + table + "\n" + end + rest.split(end, 1)[1]  # (an empty block is filled too)
    return text


def curves(batch: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Per arm label, per figure (held-out success, facts kept): the mean over the arm's runs at each evaluation."""
    import gzip

    by: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for path in sorted(batch.glob("runs/*/*/metrics.jsonl.gz")):
        rows = [json.loads(x) for x in gzip.decompress(path.read_bytes()).decode().splitlines() if x.strip()]
        config = (path.parent / "config.toml").read_text()
        objective = "sft" if 'objective = "sft"' in config else "rl"
        name = path.parent.parent.name  # fh135-b0-sS-ARMBUDGET-VARIANT
        arm = name.split("-", 3)[3]
        key = next((label for (a, variant, obj), label in ARMS.items()
                    if arm.startswith(a) and arm.endswith(variant) and obj == objective), None)
        if key is None:
            continue
        for r in rows:
            if r.get("phase") == "eval" and r.get("split") == "heldout":
                by[key]["success"][r["step"]].append(r["success"])
                kept = r.get("task_fact_survival")  # per task, then their mean: as the table's column
                if kept:
                    by[key]["facts kept"][r["step"]].append(sum(kept.values()) / len(kept))
    return {label: {fig: sorted((s, sum(v) / len(v)) for s, v in steps.items()) for fig, steps in figs.items()}
            for label, figs in by.items()}


def plot(batch: Path, path: Path) -> Path:
    """Held-out success (left) and the answer's facts kept by each rewrite (right) by step, mean of each arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(batch)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, figure in zip(axes, ("success", "facts kept")):
        for label, figs in data.items():
            if figs.get(figure):
                steps, values = zip(*figs[figure])
                ax.plot(steps, values, marker="o", markersize=3, label=label)
        ax.set_xlabel("step (RL, or SFT-only control)")
        ax.set_ylabel("held-out success" if figure == "success" else "answer's facts a rewrite keeps (per task)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("fact_hunt, SmolLM2-135M-Instruct, 5 seeds each (mean)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
