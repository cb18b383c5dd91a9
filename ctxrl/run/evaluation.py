"""Evaluation as a run logs it: each split's success, greedy by default, with its samples (``ctxrl eval`` and the
trainer share it), and the evaluation a run logged, read back on resume."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ctxrl.config import Config
from ctxrl.eval.evaluate import evaluate_split, task_outcomes
from ctxrl.report.progress import Progress
from ctxrl.report.writer import RunWriter
from ctxrl.rollout.managers import get_manager
from ctxrl.rollout.managers.stats import context_stats
from ctxrl.rollout.worker import RolloutWorker
from ctxrl.types import SPLITS


def evaluate_splits(worker: RolloutWorker, config: Config, writer: RunWriter, step: int,
                    splits: tuple[str, ...] = SPLITS, progress: Progress | None = None) -> dict[str, dict[str, float]]:
    """Evaluate ``splits`` with ``worker`` and log each (``ctxrl eval`` and the trainer)."""
    results = {}
    trials = config.meta.eval_trials
    for split in splits:
        t0 = time.perf_counter()
        name = f"eval (step {step}, {split})"
        summary, episodes = evaluate_split(worker, split, config.eval.tasks, seed=config.eval.seed,
                                           trials_per_task=trials,
                                           on_episode=None if progress is None else
                                           lambda done, total, name=name: progress.stage(name, done, total))
        errored = [e for e in episodes if e.truncation == "error"]
        if errored and progress is not None:
            progress.errored(name, len(errored), len(episodes), errored[0].info.get("error"))
        if any(e.info.get("demos") for e in episodes):
            raise RuntimeError("an evaluation episode was shown demonstrations; evaluation must be zero-shot")
        summary["seconds"] = time.perf_counter() - t0
        if get_manager(config.context.manager).rewrites_context:
            summary.update(context_stats(episodes))
        summary.update(task_outcomes(episodes))
        writer.log_metrics({"phase": "eval", "step": step, "split": split, **summary})
        writer.log_samples(step, episodes[:2], worker.renderer.decode, phase=f"eval-{split}")
        results[split] = summary
    return results


def logged_eval(run_dir: Path, step: int) -> dict[str, dict[str, float]]:
    """The evaluation rows of ``step`` in ``metrics.jsonl``, by split (for a resumed run's summary)."""
    rows: dict[str, dict[str, float]] = {}
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("phase") == "eval" and row.get("step") == step:
                rows[row["split"]] = row
    return rows
