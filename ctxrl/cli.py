"""``ctxrl`` command line: demo, train, eval, envs."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ctxrl.config import Config, ConfigError, load_config
from ctxrl.train.checkpoint import CheckpointError

def _default_run_dir(config: Config) -> Path:
    return Path("runs") / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


class GracefulStop:
    """SIGINT / SIGTERM ask the run to stop after the current step (a second SIGINT abandons it)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        import threading

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


class RunStopped(Exception):
    """The run stopped early on a signal, resumably; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def logged_eval(run_dir: Path, step: int) -> dict[str, dict[str, float]]:
    """The evaluation rows of ``step`` in ``metrics.jsonl``, by split (for a resumed run's summary)."""
    rows: dict[str, dict[str, float]] = {}
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("phase") == "eval" and row.get("step") == step:
                rows[row["split"]] = row
    return rows


def run_pipeline(config: Config, run_dir: Path, *, quiet: bool = False, resume: bool = False) -> dict[str, Any]:
    """Warm start (if enabled), evaluate, RL, evaluate again; write the run directory.

    ``resume``: continue from ``run_dir/checkpoints/latest`` instead (no warm start; the
    evaluation before RL is read back from ``metrics.jsonl``). RL checkpoints are written every
    ``train.checkpoint_every`` steps and when a signal stops the run.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ctxrl.report.plots import plot_run
    from ctxrl.train.loop import Run

    console = Console(stderr=True, quiet=quiet or not config.run.progress)
    started = time.perf_counter()
    if resume and not (run_dir / "checkpoints").exists():
        raise CheckpointError(f"--resume: {run_dir} holds no run (no checkpoints directory); check --run-dir")
    metrics = run_dir / "metrics.jsonl"
    if not resume and metrics.exists() and metrics.stat().st_size > 0:
        raise CheckpointError(f"{run_dir} already holds a run ({metrics} is not empty); continue it with --resume, "
                              "or choose another --run-dir: a new run would mix its logs with the old one's")
    run = Run(config, run_dir)
    console.print(f"[bold]ctxrl[/bold] run dir {run_dir} | model {config.model.name} on {run.device} | "
                  f"env {config.env.name}" + (" | resuming" if resume else ""))
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}")]
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    every = config.train.checkpoint_every
    with GracefulStop() as stop, Progress(*columns, console=console, transient=False) as progress:
        if resume:
            learner = run.make_learner()
            first = run.resume(learner)
            before = logged_eval(run_dir, 0)
            if not before:
                raise CheckpointError(f"{run_dir}/metrics.jsonl has no evaluation of step 0; the log does not "
                                      "belong to this checkpoint")
            if first > config.train.steps:
                raise CheckpointError(f"the checkpoint is after step {first}, beyond train.steps={config.train.steps}; "
                                      f"set train.steps >= {first}")
            progress.console.print(f"resumed from {run_dir / 'checkpoints' / 'latest'} after step {first}")
        else:
            if config.sft.enabled:
                bar = progress.add_task("warm start (SFT)", total=None, info="")

                def on_sft(step: int, total: int, loss: float) -> None:
                    progress.update(bar, completed=step, total=total, info=f"loss {loss:.3f}")

                sft = run.warm_start(on_step=on_sft)
                summary["sft_loss_last"] = sft["sft_loss_last"]
            before = run.evaluate(0)
            learner = run.make_learner()
            first = 0
            if every:  # the warm start is expensive: resumable from here on
                run.save_training_checkpoint(0, learner)
        progress.console.print(f"after warm start: heldout {before['heldout']['success']:.2f}  "
                               f"ood {before['ood']['success']:.2f}")
        steps = config.train.steps
        bar = progress.add_task(f"RL ({config.algo.advantage}, {config.algo.loss})", total=steps, completed=first,
                                info="")
        done = first
        for step in range(first, steps):
            if stop.signal is not None:
                break
            row = run.rl_step(learner, step)
            done = step + 1
            info = (f"reward {row['reward']:.2f} success {row['success']:.2f} tools/ep {row['tool_calls']:.2f} "
                    f"{row['time_step']:.1f}s/step")
            if config.train.eval_every and done % config.train.eval_every == 0 and done < steps:
                mid = run.evaluate(done, splits=("heldout",))
                info += f" | heldout {mid['heldout']['success']:.2f}"
            if every and done % every == 0:
                run.save_training_checkpoint(done, learner)
            progress.update(bar, advance=1, info=info)
        if stop.signal is not None and done < steps:
            name = signal.Signals(stop.signal).name
            if every:
                if done % every and done > first:  # (done == first: latest already holds this state)
                    run.save_training_checkpoint(done, learner)
                hint = f"resume with --run-dir {run_dir} --resume"
            else:
                hint = "no checkpoint was written (train.checkpoint_every=0), so it cannot be resumed"
            run.writer.close()
            raise RunStopped(f"stopped by {name} after step {done} of {steps}; {hint}", 128 + stop.signal)
        after = run.evaluate(steps) if steps else before
    checkpoint = run.save_checkpoint("final")
    run.writer.close()
    plots = plot_run(run_dir)
    summary.update({
        "heldout_success_before": before["heldout"]["success"],
        "heldout_success_after": after["heldout"]["success"],
        "ood_success_before": before["ood"]["success"],
        "ood_success_after": after["ood"]["success"],
        "train_success_before": before["train"]["success"],
        "train_success_after": after["train"]["success"],
        # generalisation gap: success on training-distribution tasks minus success on the split
        "gap_heldout_after": after["train"]["success"] - after["heldout"]["success"],
        "gap_ood_after": after["train"]["success"] - after["ood"]["success"],
        "tool_calls_before": before["heldout"]["tool_calls"],
        "tool_calls_after": after["heldout"]["tool_calls"],
        "steps": steps,
        "resumed_from": first if resume else None,
        "skipped_updates": learner.skipped_updates,
        "checkpoint": str(checkpoint),
        "plots": [str(p) for p in plots],
        "device": run.device,
        "wall_seconds": round(time.perf_counter() - started, 1),
    })
    for split in ("heldout", "ood"):  # trials at evaluation (meta): success by the last attempt, next to attempt 1's
        if "trial_success" in after[split]:
            summary[f"{split}_trial_success_before"] = before[split].get("trial_success")
            summary[f"{split}_trial_success_after"] = after[split]["trial_success"]
    return summary


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="success per split, before vs after RL (greedy)")
    table.add_column("split")
    table.add_column("after warm start", justify="right")
    table.add_column("after RL", justify="right")
    table.add_column("change", justify="right")
    for split in ("train", "heldout", "ood"):
        b, a = summary[f"{split}_success_before"], summary[f"{split}_success_after"]
        table.add_row(split, f"{b:.2f}", f"{a:.2f}", f"{a - b:+.2f}")
    for split in ("heldout", "ood"):
        table.add_row(f"generalisation gap (train - {split})", "", f"{summary[f'gap_{split}_after']:+.2f}", "")
    table.add_row("tool calls / episode (heldout)", f"{summary['tool_calls_before']:.2f}",
                  f"{summary['tool_calls_after']:.2f}", "")
    console = Console()
    console.print(table)
    console.print(f"run directory: {summary['run_dir']}  ({summary['steps']} steps, {summary['wall_seconds']}s)")


def _config_from_args(path: str | None, args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    return load_config(path, overrides)


def cmd_demo(args: argparse.Namespace) -> int:
    config = _config_from_args(None, args)
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(config)
    summary = run_pipeline(config, run_dir, quiet=args.json and not sys.stderr.isatty())
    print_table(summary)
    if args.json:
        print(json.dumps(summary))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    config = _config_from_args(args.config, args)
    if args.resume and not args.run_dir:
        raise CheckpointError("--resume needs --run-dir: the directory of the run to continue")
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(config)
    summary = run_pipeline(config, run_dir, resume=args.resume)
    print_table(summary)
    if args.json:
        print(json.dumps(summary))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ctxrl.train.loop import Run

    overrides = [*args.overrides, f"model.name={json.dumps(str(args.checkpoint))}", "sft.enabled=false"]
    config = load_config(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(config).with_name(
        f"eval-{time.strftime('%Y%m%d-%H%M%S')}")
    run = Run(config, run_dir)
    splits = (args.split,) if args.split else ("train", "heldout", "ood")
    results = run.evaluate(0, splits=splits)
    run.writer.close()
    table = Table(title=f"evaluation of {args.checkpoint}")
    for column in ("split", "success", "reward", "tool calls/ep", "turns/ep"):
        table.add_column(column)
    for split, r in results.items():
        table.add_row(split, f"{r['success']:.3f}", f"{r['reward']:.3f}", f"{r['tool_calls']:.2f}", f"{r['turns']:.2f}")
    Console().print(table)
    gaps = {f"gap_{split}": results["train"]["success"] - results[split]["success"]
            for split in ("heldout", "ood") if "train" in results and split in results}
    if gaps:
        Console().print("generalisation gap (train - split): " + ", ".join(f"{k[4:]} {v:+.3f}" for k, v in gaps.items()))
    if args.json:
        print(json.dumps({"checkpoint": str(args.checkpoint), **{k: v for k, v in results.items()}, **gaps}))
    return 0


def cmd_envs(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ctxrl.envs.registry import get_env_class, list_envs

    table = Table(title="environments")
    for column in ("name", "tools", "context", "train range", "ood range", "meaning"):
        table.add_column(column)
    for name in list_envs():
        cls = get_env_class(name)
        if callable(getattr(cls, "configure", None)):  # built from data: nothing to show until configured
            table.add_row(name, "env.tools", "-", "-", "-", "tasks from env.data (JSONL), see its docs")
            continue
        env = cls()
        tools = ", ".join(t.name for t in env.tools)
        env.close()
        for i, p in enumerate(cls.context_space.describe()):
            if "choices" in p:
                train, ood = ", ".join(map(str, p["choices"])), "-"
            else:
                train, ood = "{}..{}".format(*p["train"]), "{}..{}".format(*p["ood"])
            table.add_row(name if i == 0 else "", tools if i == 0 else "", p["name"], train, ood, p["description"])
    Console().print(table)
    return 0


def cmd_check_env(args: argparse.Namespace) -> int:
    """Run the conformance suite on an environment; exit 1 listing every problem."""
    from ctxrl.envs.base import EnvError
    from ctxrl.envs.check import check_env
    from ctxrl.envs.registry import configured_env_class

    try:
        cls = configured_env_class(args.name, data=args.data, tools=args.tools, verifier=args.verifier)
    except EnvError as exc:
        print(f"ctxrl: {exc}", file=sys.stderr)
        return 2
    problems = check_env(cls, n_tasks=args.tasks, seed=args.seed)
    if args.json:
        print(json.dumps({"env": args.name, "ok": not problems, "problems": problems}))
    elif problems:
        print(f"{args.name}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  - {problem}")
    else:
        print(f"{args.name}: OK (seeded sampling and reset, splits, tool schemas, gold solutions score 1.0 on "
              f"every split, step after the end is an error, close twice)")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctxrl", description="Multi-turn RL for LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--run-dir", help="run directory (default runs/<name>-<time>)")
        p.add_argument("--steps", type=int, help="RL steps (same as train.steps=N)")
        p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
        p.add_argument("overrides", nargs="*", help="section.field=value overrides")

    demo = sub.add_parser("demo", help="train the tiny model on the calculator env and show it improve")
    common(demo)
    demo.set_defaults(fn=cmd_demo)
    train = sub.add_parser("train", help="train from a TOML config")
    train.add_argument("config")
    train.add_argument("--resume", action="store_true", help="continue the run in --run-dir from checkpoints/latest")
    common(train)
    train.set_defaults(fn=cmd_train)
    ev = sub.add_parser("eval", help="evaluate a checkpoint")
    ev.add_argument("config")
    ev.add_argument("--checkpoint", required=True, help="checkpoint directory (e.g. RUN/checkpoints/final)")
    ev.add_argument("--split", choices=("heldout", "ood", "train"))
    ev.add_argument("--run-dir")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("overrides", nargs="*")
    ev.set_defaults(fn=cmd_eval)
    envs = sub.add_parser("envs", help="list environments and their context spaces")
    envs.set_defaults(fn=cmd_envs)
    check = sub.add_parser("check-env", help="run the environment conformance suite")
    check.add_argument("name", help="registered name, entry point, or package.module:Class")
    check.add_argument("--tasks", type=int, default=8, help="tasks per split to check (default 8)")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")
    check.add_argument("--data", default="", help="task file, for environments built from data (jsonl_tools)")
    check.add_argument("--tools", default="", help="comma-separated built-in tools (jsonl_tools)")
    check.add_argument("--verifier", default="exact", help="answer check (jsonl_tools): exact, numeric, contains")
    check.set_defaults(fn=cmd_check_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`eval CONFIG --checkpoint X train.steps=3`); argparse leaves
    # those unparsed once the positional list has been filled, so collect them here.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        if not hasattr(args, "overrides"):
            parser.error(f"{args.command} takes no overrides: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"ctxrl: config error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"ctxrl: checkpoint error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        print(f"ctxrl: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        from ctxrl.train.loop import TrainingAborted

        if isinstance(exc, TrainingAborted):
            print(f"ctxrl: run aborted: {exc}", file=sys.stderr)
            return 3
        raise
    except KeyboardInterrupt:
        print("ctxrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
