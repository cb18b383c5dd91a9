"""The outer loop of a run: cadence (evaluations, checkpoints), signals, resume, and the summary; and the phases
outside the RL step that it runs.

``fit(run, resume=)`` runs a built run (``ctxrl.run.build``) on rank 0: warm start (``warm_start``, if enabled), the
evaluation before RL (``evaluate``; read back from ``metrics.jsonl`` on resume), the RL steps
(``ctxrl.run.step.rl_step``) with held-out evaluations every ``train.eval_every`` steps and checkpoints every
``train.checkpoint_every``, a graceful stop on SIGINT / SIGTERM (checkpointed, resumable), then the final evaluation,
checkpoint (``save_final``) and plots; ``report.html`` (``ctxrl.report.html``) is rewritten after every evaluation.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ctxrl.errors import CheckpointError, CtxrlError, StorageError
from ctxrl.run import checkpoint
from ctxrl.run import step as step_module
from ctxrl.run.build import close, start_learning
from ctxrl.run.evaluation import evaluate_splits, logged_eval
from ctxrl.run.health import TrainingAborted
from ctxrl.run.parts import Run
from ctxrl.types import SPLITS


class RunStopped(Exception):
    """The run stopped early on a signal, resumably; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def fit(run: Run, *, resume: bool = False) -> dict[str, Any]:
    """Run ``run`` to its end (the module docstring); returns the summary. ``resume``: continue from
    ``checkpoints/latest`` instead (no warm start; the evaluation before RL is read back from ``metrics.jsonl``). A
    follower rank of a data-parallel learner only takes the leader's rows and updates with it."""
    if not run.leader:
        return run.followers.follow(run.policy, lambda: start_learning(run))
    try:
        return lead(run, resume)
    finally:
        run.followers.release()  # (nothing to do in one process)
        close(run)  # (a run that failed too: its MCP servers stop with it)


def lead(run: Run, resume: bool) -> dict[str, Any]:
    """The leader's run (the module docstring); returns the run's summary."""
    config, run_dir = run.config, run.writer.dir
    started = time.perf_counter()
    run.progress.message(f"[bold]ctxrl[/bold] run dir {run_dir} | model {config.model.name} on {run.device} | "
                             f"env {config.env.name}" + (" | resuming" if resume else ""))
    every = config.train.checkpoint_every
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    with GracefulStop() as stop:
        if resume:
            first, before = resume_run(run)
        else:
            if config.sft.enabled:
                summary["sft_loss_last"] = warm_start(run)["sft_loss_last"]
            before = evaluate(run, 0)
            run.followers.start(run.policy)
            start_learning(run)
            first = 0
            if every:  # the warm start is expensive: resumable from here on
                checkpoint.save(run, 0)
        if run.memory is not None:  # what each run records of its plan (benchmarks/shared_gpu.py reads it)
            run.writer.log_metrics({"phase": "memory", "step": first, **run.memory.figures()})
        write_report(run)
        run.progress.message(("after warm start: " if config.sft.enabled else "before RL: ") + "  ".join(
            f"{split} {before[split]['success']:.2f}" for split in ("heldout", "ood") if split in before))
        steps = config.train.steps
        run.progress.rl_start(f"RL ({config.algo.advantage}, {config.algo.loss})" if config.train.objective == "rl"
                                  else "SFT-only control", steps, first)
        done = first
        for step in range(first, steps):
            if stop.signal is not None:
                break
            try:
                row = step_module.rl_step(run, step)
            except (TrainingAborted, CtxrlError):
                raise
            except Exception as exc:  # a ctxrl, engine or learner failure: stop with its traceback
                _add_note(exc, crash_note(run, step))
                raise
            done = step + 1
            figures = ([f"reward {row['reward']:.2f}", f"success {row['success']:.2f}"] if "reward" in row
                       else [f"sft loss {row['sft_loss']:.3f}"])
            if config.train.eval_every and done % config.train.eval_every == 0 and done < steps:
                for split, result in evaluate(run, done, splits=("heldout",)).items():
                    figures.append(f"{split} {result['success']:.2f}")
                write_report(run)
            figures += [f"tools/ep {row['tool_calls']:.2f}"] if "tool_calls" in row else []
            figures.append(f"{row['time_step']:.1f}s/step")
            if every and done % every == 0:
                checkpoint.save(run, done)
            run.progress.rl_step(figures)
        if stop.signal is not None and done < steps:
            stopped(run, stop.signal, done, first)
        after = evaluate(run, steps) if steps else before
    summary.update({"steps": steps, "resumed_from": first if resume else None, "warm_start": config.sft.enabled,
                    "objective": config.train.objective})
    return finish(run, summary, before, after, started)


def warm_start(run: Run, on_step=None) -> dict[str, Any]:
    """Supervised warm start of the policy (``[sft]``); the engine gets the result as policy version 0.
    ``on_step(step, total, loss)`` after each optimiser step (default: the progress display)."""
    from ctxrl.train.warm_start import warm_start as train_warm_start

    row, demos = train_warm_start(run.config, run.spec, run.env_cls, run.renderer, run.model,
                                  under_manager=run.context_demos, on_step=on_step or run.progress.sft,
                                  precision=run.policy.precision, micro_batch_tokens=run.micro_batch_tokens)
    run.own.after_warm_start()
    step_module.sync_engine(run, 0)
    run.writer.log_metrics(row)
    run.writer.log_samples(0, demos[:2], run.renderer.decode, phase="sft")
    return row


def evaluate(run: Run, step: int, splits: tuple[str, ...] = SPLITS) -> dict[str, dict[str, float]]:
    """Success (and tool use) on ``eval.tasks`` tasks of each split, greedy by default, on the learner's current
    weights; logged per split. A split the environment has no tasks for is skipped, and said so once."""
    missing = [s for s in SPLITS if s not in run.splits]
    if missing and not run.skipped_reported:
        run.skipped_reported = True
        run.progress.message(f"note: environment {run.config.env.name!r} has no {' or '.join(missing)} tasks: "
                             "evaluation skips " + ("that split" if len(missing) == 1 else "those splits"))
        run.writer.log_metrics({"phase": "note", "step": step, "skipped_splits": missing})
    with step_module.current_weights(run):
        return evaluate_splits(run.worker, run.config, run.writer, step, tuple(s for s in splits if s in run.splits),
                               run.progress)


def save_final(run: Run, name: str) -> Path:
    """The policy's weights and tokenizer under ``checkpoints/NAME``, for other tools to load: full fine-tuning, an
    HF checkpoint in ``model.dtype`` in transformers' own layout (which may shard or convert to the hub's names;
    step checkpoints keep the module's names); LoRA, the adapters in PEFT's format (a role's own in ``ROLE/``), and
    with ``lora.export_merged`` the base with the shared adapters merged in (``NAME-merged``)."""
    from ctxrl.learner.policy import export_merged

    checkpoint.refuse_non_finite(run, name)
    path = run.policy.save(run.writer.dir / "checkpoints" / name, run.tokenizer)
    if run.policy.is_lora and run.config.lora.export_merged:
        export_merged(path, path.with_name(f"{name}-merged"), dtype=run.config.model.dtype)
    return path


def finish(run, summary: dict[str, Any], before: dict, after: dict, started: float) -> dict[str, Any]:
    """The final checkpoint, the logs closed, the plots drawn; ``summary`` completed with the before/after figures."""
    final = save_final(run, "final")
    run.writer.close()
    close(run)
    from ctxrl.report.plots import plot_run

    plots = plot_run(run.writer.dir)
    report = write_report(run)
    summary.update(_summary(before, after))
    summary.update({"skipped_updates": run.learner.skipped_updates, "checkpoint": str(final),
                    "plots": [str(p) for p in plots], "report": report and str(report), "device": run.device,
                    "wall_seconds": round(time.perf_counter() - started, 1)})
    return summary


def write_report(run) -> Path | None:
    """``RUN_DIR/report.html`` from the logs so far (``ctxrl report``); a page that cannot be written is said, and the
    run goes on: it is a view of the logs, which are intact."""
    from ctxrl.report.html import write_report as write_page

    try:
        return write_page(run.writer.dir)
    except (OSError, ValueError) as exc:
        run.progress.message(f"report.html not written: {exc}")
        return None


def resume_run(run) -> tuple[int, dict[str, dict[str, float]]]:
    """Load ``checkpoints/latest``; (the step to go on from, the evaluation before RL read back from the log)."""
    start_learning(run)
    first = checkpoint.resume(run)
    before = logged_eval(run.writer.dir, 0)
    if not before:
        raise CheckpointError(f"{run.writer.dir}/metrics.jsonl has no evaluation of step 0; the log does not "
                              "belong to this checkpoint")
    if first > run.config.train.steps:
        raise CheckpointError(f"the checkpoint is after step {first}, beyond "
                              f"train.steps={run.config.train.steps}; set train.steps >= {first}")
    run.progress.message(f"resumed from {run.writer.dir / 'checkpoints' / 'latest'} after step {first}")
    return first, before


def crash_note(run, step: int) -> str:
    """Where to go on from after a failure in RL step ``step`` (0-based)."""
    newest = newest_checkpoint(run.writer.dir)
    if newest is not None:
        return (f"ctxrl: RL step {step + 1} failed; the newest checkpoint is {newest}: "
                f"after fixing the cause, continue with --run-dir {run.writer.dir} --resume")
    return (f"ctxrl: RL step {step + 1} failed; no checkpoint was written (train.checkpoint_every="
            f"{run.config.train.checkpoint_every}), so the run cannot be resumed")


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``run_dir/checkpoints/latest`` names, or None (none written, or it cannot be read)."""
    latest = run_dir / "checkpoints" / "latest"
    try:
        name = latest.read_text().strip()
    except OSError:
        return None
    return latest.parent / name if name else None


STORAGE_ERRNOS = {errno.ENOSPC: "the file system is full: free some space",
                  errno.EDQUOT: "the disk quota is used up: free some space",
                  errno.EROFS: "the file system is read-only: mount it read-write or choose another --run-dir",
                  errno.EACCES: "no permission: make it writable for this user",
                  errno.EPERM: "no permission: make it writable for this user"}
"""The errors of a run directory that cannot be written, and what to do about each."""


def storage_error(exc: BaseException, run_dir: Path, checkpoint_every: int) -> StorageError | None:
    """``exc`` (an ``OSError``, or safetensors' error for one) as one line naming the path and how the run goes on
    once it can be written; None when it is not a file system's refusal (``STORAGE_ERRNOS``)."""
    from ctxrl.run.checkpoint_io import os_errno

    code = os_errno(exc)
    if code not in STORAGE_ERRNOS or isinstance(exc, CtxrlError):
        return None
    path = getattr(exc, "filename", None) or run_dir
    newest = newest_checkpoint(run_dir)
    if newest is not None:
        then = (f"The run stopped; the newest checkpoint is {newest}: once {run_dir} can be written, continue with "
                f"--run-dir {run_dir} --resume")
    else:
        then = (f"The run stopped before any checkpoint (train.checkpoint_every={checkpoint_every}), so it cannot be "
                "resumed: once it can be written, start it again with a fresh --run-dir")
    return StorageError(f"cannot write {path}: {os.strerror(code)} ({STORAGE_ERRNOS[code]}). {then}.")


def stopped(run, signum: int, done: int, first: int) -> None:
    """Checkpoint (at the cadence's terms) and raise ``RunStopped`` after a signal stopped the run at step ``done``."""
    every, run_dir = run.config.train.checkpoint_every, run.writer.dir
    if every:
        if done % every and done > first:  # (done == first: latest already holds this state)
            checkpoint.save(run, done)
        hint = f"resume with --run-dir {run_dir} --resume"
    else:
        hint = "no checkpoint was written (train.checkpoint_every=0), so it cannot be resumed"
    run.writer.close()
    close(run)
    raise RunStopped(f"stopped by {signal.Signals(signum).name} after step {done} of {run.config.train.steps}; "
                     f"{hint}", 128 + signum)


class GracefulStop:
    """SIGINT / SIGTERM ask the run to stop after the current step (a second SIGINT abandons it)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: abandon the step now
        self.signal = signum
        # os.write, not print: a handler that prints can hit a print already in progress
        os.write(2, f"\nctxrl: {signal.Signals(signum).name} received: stopping after this step "
                    "(Ctrl-C again abandons it)\n".encode())

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to the traceback ``exc`` will print (Python 3.11+), or print it now."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        print(note, file=sys.stderr)


def _summary(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The before/after figures of a run's summary (None for a split the environment has no tasks for)."""

    def get(results: dict, split: str, key: str) -> float | None:
        return results[split][key] if split in results else None

    out: dict[str, Any] = {}
    for split in SPLITS:
        out[f"{split}_success_before"] = get(before, split, "success")
        out[f"{split}_success_after"] = get(after, split, "success")
    for split in ("heldout", "ood"):  # generalisation gap: success on the training distribution minus the split's
        train, other = get(after, "train", "success"), get(after, split, "success")
        out[f"gap_{split}_after"] = None if train is None or other is None else train - other
    source = "heldout" if "heldout" in after else "train"
    out["tool_calls_before"] = get(before, source, "tool_calls")
    out["tool_calls_after"] = get(after, source, "tool_calls")
    for split in ("heldout", "ood"):  # trials at evaluation (meta): success by the last attempt, next to attempt 1's
        if "trial_success" in after.get(split, {}):
            out[f"{split}_trial_success_before"] = before[split].get("trial_success")
            out[f"{split}_trial_success_after"] = after[split]["trial_success"]
    return out
