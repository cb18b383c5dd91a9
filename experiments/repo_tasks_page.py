"""The measured block of docs/environments.md's ``repo_tasks`` section, from its committed records
(``experiments/tables.py repo-tasks``).

Issue 56's measurement: SmolLM2-135M-Instruct on ``repo_tasks``' easiest split, 3 seeds, RL against its SFT-only
control (``experiments/plans/issue56.toml``). The records are ``docs/experiments/data/issue56/batch/``: each run's
log, config and gzipped metrics and samples, as ``experiments/batch.py`` wrote them. A run's figures are its
evaluation rows: after the warm start (step 0) and after its last step, on train, held-out and OOD tasks, each with
its per-task outcomes (``task_success``), so that intervals are ``experiments/stats.py``'s two-level bootstrap over
seeds and tasks, and RL's share is paired seed by seed and task by task.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stats  # noqa: E402  (a sibling script, not a package)

DATA = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "data" / "issue56" / "batch"
SPLITS = ("train", "heldout", "ood")
ARMS = {"rl": "RL", "sft": "SFT-only control"}
"""``train.objective`` -> the arm's label, in the page's order."""


def read_run(run_dir: Path) -> dict:
    """One run: its seed, objective, last step, and per split the evaluation after the warm start and after the
    last step (``SeedOutcome`` with per-task outcomes and the draw, ``eval.seed``)."""
    (inner,) = [d for d in run_dir.iterdir() if d.is_dir()]
    config = tomllib.loads((inner / "config.toml").read_text())
    with gzip.open(inner / "metrics.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = [r for r in rows if r.get("phase") == "eval"]
    last = max(r["step"] for r in evals)
    draw = config["eval"]["seed"]
    out = {"name": run_dir.name, "seed": config["run"]["seed"], "objective": config["train"].get("objective", "rl"),
           "steps": last, "before": {}, "after": {}}
    for r in evals:
        when = "before" if r["step"] == 0 else "after" if r["step"] == last else None
        if when and r["split"] in SPLITS:
            out[when][r["split"]] = stats.SeedOutcome(r["success"], r.get("task_success"), draw)
    missing = [f"{w} {s}" for w in ("before", "after") for s in SPLITS if s not in out[w]]
    if missing:
        raise ValueError(f"{run_dir}: no evaluation for {', '.join(missing)}: the run did not finish")
    return out


def read_runs(batch: Path = DATA) -> dict[str, list[dict]]:
    """Every run of the batch by arm label (``ARMS``), ordered by seed; the arms must share their seeds."""
    runs = [read_run(d) for d in sorted((batch / "runs").iterdir()) if d.is_dir()]
    arms = {label: sorted((r for r in runs if r["objective"] == key), key=lambda r: r["seed"])
            for key, label in ARMS.items()}
    seeds = {label: [r["seed"] for r in rs] for label, rs in arms.items()}
    if len({tuple(s) for s in seeds.values()}) != 1:
        raise ValueError(f"the arms must share their seeds to pair: {seeds}")
    return arms


def _cell(iv) -> str:
    if math.isnan(iv.low):
        return f"{iv.mean:.2f}"
    return f"{iv.mean:.2f} [{iv.low:.2f}, {iv.high:.2f}]"


def _signed(iv) -> str:
    return f"{iv.mean:+.2f} [{iv.low:+.2f}, {iv.high:+.2f}]"


def arms_table(arms: dict[str, list[dict]]) -> str:
    """Per arm and split: success after the warm start and after the last step, with 95% intervals."""
    lines = ["| arm | split | seeds | tasks a seed | after the warm start [95%] | after RL / SFT steps [95%] |",
             "|---|---|---|---|---|---|"]
    for label, runs in arms.items():
        for split in SPLITS:
            before = stats.bootstrap_mean([r["before"][split] for r in runs])
            after = stats.bootstrap_mean([r["after"][split] for r in runs])
            lines.append(f"| {label} | {split} | {len(runs)} | {after.n_tasks} | {_cell(before)} | {_cell(after)} |")
    return "\n".join(lines)


def share_table(arms: dict[str, list[dict]]) -> str:
    """RL − SFT-only after the last step, per split: the mean with its 95% interval over seeds and tasks, the seeds'
    own differences, and the paired t and exact sign-flip tests over seeds."""
    rl, control = arms[ARMS["rl"]], arms[ARMS["sft"]]
    lines = ["| split | RL − SFT-only [95%] | per seed | paired t-test p | sign-flip p | n |",
             "|---|---|---|---|---|---|"]
    for split in SPLITS:
        a, b = [r["after"][split] for r in rl], [r["after"][split] for r in control]
        diff = stats.bootstrap_difference(a, b)
        per_seed = stats.seed_differences(a, b)
        _, _, p = stats.paired_t_test(per_seed)
        lines.append(f"| {split} | {_signed(diff)} | {', '.join(f'{d:+.3f}' for d in per_seed)} | "
                     f"{'–' if math.isnan(p) else f'{p:.2f}'} | {stats.sign_flip_p(per_seed):.2f} | "
                     f"{len(per_seed)} seeds × {diff.n_tasks} tasks |")
    return "\n".join(lines)


def page_tables(batch: Path = DATA) -> dict[str, str]:
    """The generated blocks of the page, by name."""
    arms = read_runs(batch)
    return {"repo-tasks-arms": arms_table(arms), "repo-tasks-share": share_table(arms)}
