"""Run a plan of experiment processes on the GPUs of one machine: tiny models built once, then N runs per GPU.

A plan is a TOML file (``experiments/plans/`` holds the ones the docs quote)::

    [vars]                                   # text reused below as {name}
    big = "hidden_size=256,num_layers=6,intermediate_size=768,pretrain_steps=1500,pretrain_lr=2e-3"

    [models]                                 # models built (tiny) or converted (GGUF) once, before the runs naming them
    fh_b0 = "tiny:envs=calculator+fact_hunt,{big},seed=0"

    [[run]]
    name = "fh5-b0-s0-window"                # its directory: OUT/runs/NAME ({out} in cmd)
    cmd = "python experiments/context.py --model {fh_b0} --managers window --out {out} run.seed=0"

    [[run]]
    name = "fh5-b0-s0-distill"               # a run that needs another's output: an RL-trained teacher
    needs = ["fh5-b0-s0-window"]             # (runs named above it); {runs} is OUT/runs
    cmd = "python benchmarks/env_training.py ... algo.distill.teacher={runs}/fh5-b0-s0-window/..."

Every model is built once, in its own process, the builds spread over the GPUs. A run starts once
the models it names are built and the runs it ``needs`` are done (at once if it needs nothing), on the
GPU with the fewest processes,
while that GPU has fewer than ``--per-gpu`` (a build's log ends with its pre-training loss, first and
last steps: a build whose loss barely fell is one to rebuild); it sees one GPU (``CUDA_VISIBLE_DEVICES``) and
its share of the CPU cores (``OMP_NUM_THREADS`` and the like: cores / (GPUs x ``--per-gpu``), unless set), and writes
its output to ``OUT/runs/NAME/log.txt``. A run whose model failed to build is skipped, and one
whose command cannot start fails alone. At ``--minutes`` every process still running is stopped
(SIGTERM, then SIGKILL after 10 s; its directory keeps what it wrote so far). A run whose needed run
failed, or was stopped or skipped, is skipped. ``OUT/status.json`` says, at every moment, which process
is where and how it ended. ``--set NAME=VALUE`` replaces a ``[vars]`` or ``[models]`` entry for one batch
(a plan's smoke run at tiny size on the CPU, ``--gpus cpu``).

    python experiments/batch.py run experiments/plans/issue21.toml --gpus 0,1,2,3 --per-gpu 8 --minutes 22
    python experiments/batch.py pack runs/batch results.tgz      # the results without checkpoints

``pack`` leaves out model weights and optimizer state, so what it writes stays small enough to copy
off a lent machine while the runs go on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

# A tiny model's build ends with its pre-training loss; a named real model or a .gguf file is converted once.
BUILD = ("import json, sys, pathlib; from ctxrl.train.tiny import ensure_model; "
         "path = pathlib.Path(ensure_model(sys.argv[1])); print(path); tiny = path / 'ctxrl_tiny.json'; "
         "print(json.loads(tiny.read_text()).get('pretraining_loss') if tiny.exists() else 'converted', flush=True)")
# Libraries that start one thread per core each: 24 runs on a 64-core machine then ran 1,500 threads (load 574,
# every run two to three times slower than alone). Each child gets its share of the cores instead.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")
GPU_SHARE_VARIABLE = "CTXRL_GPU_SHARE"  # ctxrl.learner.memory.GPU_SHARE_VARIABLE (this script imports no ctxrl)
HEAVY = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npy")
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class PlanError(ValueError):
    """A plan that cannot run; the message names the entry and the fix."""


@dataclass
class Job:
    name: str
    argv: list[str]
    needs: list[str] = field(default_factory=list)
    kind: str = "run"
    state: str = "waiting"  # waiting -> running -> done | failed | stopped | skipped
    gpu: str | None = None
    started: float | None = None
    ended: float | None = None
    returncode: int | None = None
    process: subprocess.Popen | None = None

    def report(self, t0: float) -> dict:
        def rel(t):
            return None if t is None else round(t - t0, 1)

        return {"name": self.name, "kind": self.kind, "state": self.state, "gpu": self.gpu, "needs": self.needs,
                "started_s": rel(self.started), "ended_s": rel(self.ended), "returncode": self.returncode,
                "argv": self.argv}


def _fill(text: str, values: dict[str, str], where: str) -> str:
    def one(match: re.Match) -> str:
        key = match.group(1)
        if key not in values:
            raise PlanError(f"{where}: unknown placeholder {{{key}}}; define it under [vars] or [models]")
        return values[key]

    return PLACEHOLDER.sub(one, text)


def load_plan(path: Path, out: Path, python: str = sys.executable, settings: dict[str, str] | None = None) -> list[Job]:
    """Build jobs (model builds first, then runs) from a plan file; every error names its entry. ``settings``
    replace ``[vars]`` / ``[models]`` entries (``--set``)."""
    try:
        plan = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from None
    unknown = set(plan) - {"vars", "models", "run", "compare"}
    if unknown:
        raise PlanError(f"{path}: unknown sections {sorted(unknown)}; a plan has [vars], [models], [[run]] and "
                        "[[compare]] (read by experiments/plan_check.py)")
    variables = {k: str(v) for k, v in plan.get("vars", {}).items()}
    models = {k: str(v) for k, v in plan.get("models", {}).items()}
    for key, value in (settings or {}).items():
        if key not in variables and key not in models:
            raise PlanError(f"--set {key}: {path} has no such entry under [vars] or [models] "
                            f"(it has {', '.join(sorted({*variables, *models})) or 'none'})")
        (models if key in models else variables)[key] = value
    models = {k: _fill(v, variables, f"[models] {k}") for k, v in models.items()}
    clash = set(models) & set(variables)
    if clash:
        raise PlanError(f"{path}: {sorted(clash)} named in both [vars] and [models]; rename one")
    jobs = [Job(f"build-{key}", [python, "-c", BUILD, spec], kind="build") for key, spec in models.items()]
    names = set()
    for i, run in enumerate(plan.get("run", [])):
        name, cmd = run.get("name"), run.get("cmd")
        if not name or not cmd or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise PlanError(f"{path}: [[run]] #{i + 1} needs a name (letters, digits, . _ -) and a cmd")
        if name in names:
            raise PlanError(f"{path}: two runs are named {name!r}; names must be unique")
        earlier = run.get("needs", [])
        if not isinstance(earlier, list) or any(n not in names for n in earlier):
            raise PlanError(f"{path}: run {name}: needs = {earlier!r} must list runs named above it")
        names.add(name)
        needs = [f"build-{m}" for m in dict.fromkeys(PLACEHOLDER.findall(cmd)) if m in models] + list(earlier)
        text = _fill(cmd, {**variables, **models, "out": str(out / "runs" / name), "runs": str(out / "runs")},
                     f"run {name}")
        argv = shlex.split(text)
        if argv and argv[0] == "python":
            argv[0] = python  # the interpreter running the batch, so a venv carries over
        jobs.append(Job(name, argv, needs=needs))
    if not any(j.kind == "run" for j in jobs):
        raise PlanError(f"{path}: no [[run]] entries")
    return jobs


def load_plans(paths: list[Path], out: Path, python: str = sys.executable,
               settings: dict[str, str] | None = None) -> list[Job]:
    """The jobs of several plans as one batch: each plan's ``[vars]`` stay its own; a model two plans build the
    same way is built once; two runs of one name, or one model name built two ways, are a ``PlanError``.
    ``settings`` (``--set``) apply to every plan that has the entry, and must name an entry of at least one."""
    settings = settings or {}
    if len(paths) == 1:
        return load_plan(paths[0], out, python, settings)
    jobs: dict[str, Job] = {}
    used: set[str] = set()
    for path in paths:
        try:
            plan = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise PlanError(f"cannot read plan {path}: {exc}") from None
        entries = {*plan.get("vars", {}), *plan.get("models", {})}
        mine = {k: v for k, v in settings.items() if k in entries}
        used |= set(mine)
        for job in load_plan(path, out, python, mine):
            other = jobs.get(job.name)
            if other is None:
                jobs[job.name] = job
            elif job.kind == "run":
                raise PlanError(f"{path}: a run named {job.name!r} is also in an earlier plan; names must be unique "
                                "across the plans of one batch")
            elif other.argv != job.argv:
                raise PlanError(f"{path}: model {job.name.removeprefix('build-')!r} is built differently by an "
                                "earlier plan; rename it in one of them")
    unused = set(settings) - used
    if unused:
        raise PlanError(f"--set {', '.join(sorted(unused))}: no plan has such an entry under [vars] or [models]")
    builds = [j for j in jobs.values() if j.kind == "build"]
    return builds + [j for j in jobs.values() if j.kind == "run"]


def _status(jobs: list[Job], out: Path, t0: float) -> None:
    counts = {}
    for j in jobs:
        counts[j.state] = counts.get(j.state, 0) + 1
    tmp = out / "status.json.tmp"
    tmp.write_text(json.dumps({"elapsed_s": round(time.time() - t0, 1), "counts": counts,
                               "jobs": [j.report(t0) for j in jobs]}, indent=1))
    tmp.replace(out / "status.json")


def _stop(jobs: list[Job], grace: float = 10.0) -> None:
    """SIGTERM each live job's process group, wait up to ``grace`` seconds, then SIGKILL what is left.

    A trainer stuck in CUDA or in a checkpoint write must not keep a lent GPU after the batch ends.
    """
    live = [j for j in jobs if j.process is not None and j.process.poll() is None]
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for job in live:
            try:
                os.killpg(job.process.pid, signum)
            except ProcessLookupError:
                pass
        end = time.time() + grace
        while live and time.time() < end:
            live = [j for j in live if j.process.poll() is None]
            time.sleep(0.05)
        if not live:
            break
    for job in jobs:
        if job.process is not None and job.returncode is None:
            job.returncode = job.process.wait()


def child_environment(gpu: str, processes: int, cores: int | None = None,
                      environ: dict[str, str] | None = None, per_gpu: int = 1) -> dict[str, str]:
    """A child's environment: one GPU, unbuffered output, its share of the cores for every thread pool, and its
    share of the card for its memory plan (``CTXRL_GPU_SHARE=1/per_gpu``: ``ctxrl.learner.memory``).

    ``processes`` is how many children may run at once (GPUs x ``--per-gpu``); a thread count or a card share
    the user set in the environment is kept.
    """
    environ = dict(os.environ if environ is None else environ)
    share = str(max(1, (cores or os.cpu_count() or 1) // max(1, processes)))
    threads = {name: environ.get(name, share) for name in THREAD_VARIABLES}
    card = {GPU_SHARE_VARIABLE: environ.get(GPU_SHARE_VARIABLE, f"{1 / max(1, per_gpu):.6g}")}
    return {**environ, **threads, **card, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1"}


def run_plan(jobs: list[Job], out: Path, gpus: list[str], per_gpu: int, minutes: float, poll: float = 2.0) -> list[Job]:
    """Run ``jobs`` (see the module docstring) and return them with their final states."""
    if per_gpu < 1 or not gpus:
        raise PlanError("need at least one GPU (--gpus) and --per-gpu >= 1")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + minutes * 60
    by_name = {j.name: j for j in jobs}
    load = {g: 0 for g in gpus}
    try:
        while True:
            for job in jobs:
                if job.state == "running" and job.process.poll() is not None:
                    job.returncode, job.ended = job.process.returncode, time.time()
                    job.state = "done" if job.returncode == 0 else "failed"
                    load[job.gpu] -= 1
                    print(f"[{job.ended - t0:7.0f}s] {job.state:6s} {job.name} (gpu {job.gpu}, "
                          f"{job.ended - job.started:.0f}s, rc {job.returncode})", flush=True)
            for job in jobs:
                lost = [n for n in job.needs if by_name[n].state in ("failed", "skipped", "stopped")]
                if job.state == "waiting" and lost:
                    job.state = "skipped"
                    print(f"skipped {job.name}: {lost[0]}, which it needs, {by_name[lost[0]].state}", flush=True)
            if time.time() >= deadline:
                for job in jobs:
                    if job.state == "running":
                        job.state, job.ended = "stopped", time.time()
                    elif job.state == "waiting":
                        job.state = "skipped"
                print(f"[{time.time() - t0:7.0f}s] deadline of {minutes:g} minutes: stopped what was running",
                      flush=True)
                break
            for job in jobs:
                if job.state != "waiting" or any(by_name[n].state != "done" for n in job.needs):
                    continue
                gpu = min(gpus, key=lambda g: load[g])
                if load[gpu] >= per_gpu:
                    break
                directory = out / ("builds" if job.kind == "build" else "runs") / job.name
                directory.mkdir(parents=True, exist_ok=True)
                env = child_environment(gpu, len(gpus) * per_gpu, per_gpu=per_gpu)
                job.gpu, job.started = gpu, time.time()
                with open(directory / "log.txt", "w") as log:  # the child keeps its own handle
                    try:
                        job.process = subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                       start_new_session=True)
                    except OSError as exc:  # a command that cannot start fails alone, not the batch
                        log.write(f"could not start {job.argv[0]!r}: {exc}\n")
                        job.state, job.ended = "failed", time.time()
                        print(f"[{job.ended - t0:7.0f}s] failed {job.name}: could not start: {exc}", flush=True)
                        continue
                job.state = "running"
                load[gpu] += 1
                print(f"[{job.started - t0:7.0f}s] start  {job.name} on gpu {gpu}", flush=True)
            _status(jobs, out, t0)
            if all(j.state not in ("waiting", "running") for j in jobs):
                break
            time.sleep(poll)
    finally:  # also on an exception or Ctrl-C: nothing keeps running, and the status file says so
        for job in jobs:
            if job.state == "running":
                job.state, job.ended = "stopped", time.time()
        _stop(jobs)
        _status(jobs, out, t0)
    return jobs


def pack(directory: Path, target: Path) -> Path:
    """A gzipped tar of ``directory`` without weights, optimizer state (``HEAVY`` suffixes) or ``checkpoints/`` folders
    (their tokenizer files alone are megabytes a run)."""
    if not directory.is_dir():
        raise SystemExit(f"nothing to pack: {directory} is not a directory")

    def keep(info: tarfile.TarInfo):
        return None if info.name.endswith(HEAVY) or "/checkpoints/" in f"/{info.name}/" else info

    target.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(target, "w:gz") as tar:
        tar.add(directory, arcname=directory.name, filter=keep)
    return target


def progress(directory: Path) -> str:
    """One line a run of a batch directory: its state, its last step row (RL or SFT-only control) and its last
    held-out evaluation, read from what it has written so far."""
    status_path = directory / "status.json"
    if not status_path.is_file():
        return f"{directory}: no status.json yet"
    status = json.loads(status_path.read_text())
    lines = [f"{status['elapsed_s']:.0f}s: " + ", ".join(f"{n} {s}" for s, n in sorted(status["counts"].items()))]
    for job in status["jobs"]:
        if job["kind"] != "run":
            continue
        step, heldout = None, None
        for metrics in sorted((directory / "runs" / job["name"]).glob("*/metrics.jsonl")):
            for line in metrics.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # (a line being written)
                if row.get("phase") in ("rl", "sft_control"):
                    step = row
                elif row.get("phase") == "eval" and row.get("split") == "heldout":
                    heldout = row
        text = f"{job['name']:42s} {job['state']:8s}"
        if step:
            figures = (f"success {step['success']:.2f} zero-var {step.get('zero_variance_groups', '-')}"
                       if "success" in step else f"sft loss {step['sft_loss']:.3f}")
            text += f" step {step['step']:3d} {figures} {step['time_step']:.1f}s/step"
        if heldout:
            text += f" | held-out@{heldout['step']} {heldout['success']:.2f}"
        lines.append(text)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a plan")
    run.add_argument("plan", type=Path, nargs="+", help="one plan, or several run as one batch (their runs share "
                                                          "the GPUs' slots as they free)")
    run.add_argument("--out", type=Path, default=Path("runs/batch"))
    run.add_argument("--gpus", default=None, help="GPU ids, comma-separated (default: every visible GPU, or 'cpu')")
    run.add_argument("--per-gpu", type=int, default=4, help="processes at once per GPU")
    run.add_argument("--minutes", type=float, default=60.0, help="stop everything still running after this long")
    run.add_argument("--only", default=None, help="run only the runs whose name matches this regular expression "
                                                  "(and what they need)")
    run.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="replace a [vars] or [models] entry of the plan (repeatable)")
    packer = sub.add_parser("pack", help="tar.gz a batch directory without checkpoints")
    packer.add_argument("directory", type=Path)
    packer.add_argument("target", type=Path)
    watch = sub.add_parser("progress", help="where each run of a batch directory stands (while it runs)")
    watch.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        print(pack(args.directory, args.target))
        return 0
    if args.command == "progress":
        try:
            print(progress(args.directory), flush=True)
        except BrokenPipeError:  # a reader that took the lines it wanted (`| head -1`): not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        settings = dict(_setting(text) for text in args.set)
        jobs = load_plans(args.plan, args.out, settings=settings)
    except PlanError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.only:
        keep = [j for j in jobs if j.kind == "run" and re.search(args.only, j.name)]
        if not keep:
            raise SystemExit(f"error: --only {args.only!r} matches no run of {' '.join(map(str, args.plan))}")
        jobs = [j for j in jobs if j.name in needed_by(keep, jobs)]
    gpus = args.gpus.split(",") if args.gpus else _visible_gpus()
    jobs = run_plan(jobs, args.out, gpus, args.per_gpu, args.minutes)
    states = {}
    for j in jobs:
        states[j.state] = states.get(j.state, 0) + 1
    print("finished:", ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    return 0 if all(j.state == "done" for j in jobs) else 1


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise PlanError(f"--set {text!r} must look like NAME=VALUE")
    return name, value


def needed_by(keep: list[Job], jobs: list[Job]) -> set[str]:
    """The names of ``keep`` and of every job they need, directly or through another (plan order kept by caller)."""
    by_name = {j.name: j for j in jobs}
    names, todo = set(), [j.name for j in keep]
    while todo:
        name = todo.pop()
        if name not in names:
            names.add(name)
            todo += by_name[name].needs
    return names


def _visible_gpus() -> list[str]:
    try:
        import torch

        count = torch.cuda.device_count()
    except ImportError:
        count = 0
    return [str(i) for i in range(count)] or ["cpu"]


if __name__ == "__main__":
    sys.exit(main())
