"""Several training runs side by side on one GPU: does each stay within its memory plan, and do they all fit?

Starts ``--runs`` ``ctxrl train`` processes of one config at once (``--steps`` RL steps each, their own
``--run-dir`` under a temporary directory, ``run.seed`` 0, 1, ...) and waits for all of them. What each run
records itself is the figure (each sizes itself from ``1/--runs`` of the card: ``CTXRL_GPU_SHARE``, unless set):
its memory plan (the ``phase = "memory"`` row of metrics.jsonl: planned GiB, the
budget, KV slots, learner tokens per micro-batch; ``ctxrl.learner.memory``) and the most memory torch's
allocator reserved (``peak_gpu_gib`` of its RL steps). ``nvidia-smi`` is sampled as well, for what the card
sees of each process (the CUDA context included). A run that could not fit exits with a config error naming
what to change; the table shows it::

    python benchmarks/shared_gpu.py examples/calculator_tiny.toml --runs 6 --steps 3 model.name=MODEL
    python benchmarks/shared_gpu.py examples/calculator_tiny.toml --runs 8 model.gpu_memory_fraction=0.12
    python benchmarks/shared_gpu.py --dry-run     # two tiny runs on the CPU: does it run?

Needs a CUDA GPU for the memory columns; without one (``--dry-run``) they read ``-``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

DRY_RUN = ["model.name=tiny:pretrain_steps=0", "model.device=cpu", "sft.demos=4", "sft.epochs=1", "sft.batch_size=4",
           "eval.tasks=2", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
           "run.samples_per_step=0"]


def smi_memory_mib() -> dict[int, float]:
    """Device memory per process id as nvidia-smi reports it ({} without an NVIDIA driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return {}
    usage = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            usage[int(fields[0])] = float(fields[1])
    return usage


def card() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "no GPU"
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return "no GPU"


def sample(procs: list[subprocess.Popen], peaks: list[float], total: list[float]) -> None:
    """Keep each process's highest nvidia-smi figure (MiB) in ``peaks`` and the highest sum in ``total[0]``."""
    while any(p.poll() is None for p in procs):
        usage = smi_memory_mib()
        for i, p in enumerate(procs):
            peaks[i] = max(peaks[i], usage.get(p.pid, 0.0))
        total[0] = max(total[0], sum(usage.get(p.pid, 0.0) for p in procs))
        time.sleep(0.5)


def recorded(run_dir: Path) -> dict:
    """What a run wrote of its memory: the plan's row and the highest ``peak_gpu_gib`` of its steps."""
    out: dict = {"planned_gib": None, "budget_gib": None, "kv_slots": None, "learner_tokens": None,
                 "peak_gib": None}
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return out
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row.get("phase") == "memory":
            out.update({k: row[k] for k in ("planned_gib", "budget_gib", "kv_slots", "learner_tokens")})
        if "peak_gpu_gib" in row:
            out["peak_gib"] = max(out["peak_gib"] or 0.0, row["peak_gpu_gib"])
        if row.get("phase") == "eval" and row.get("split") == "heldout":  # the first and the last evaluation
            out.setdefault("heldout_first", row["success"])
            out["heldout_last"] = row["success"]
    return out


def last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    errors = [line for line in lines if line.startswith("ctxrl:") or "Error" in line]
    return (errors or lines or [""])[-1][:300]


def run_side_by_side(config: str, runs: int, steps: int, overrides: list[str], root: Path) -> tuple[list[dict], float]:
    """Start the runs together; one row each (and the highest sum of their nvidia-smi figures, MiB)."""
    procs, logs, started = [], [], time.perf_counter()
    for i in range(runs):
        log = root / f"run-{i}.log"
        logs.append(log)
        command = [sys.executable, "-m", "ctxrl", "train", config, "--steps", str(steps), "--run-dir",
                   str(root / f"run-{i}"), "run.progress=false", f"run.name=shared-{i}", f"run.seed={i}", *overrides]
        # each run plans from its share of the card (ctxrl.learner.memory.GPU_SHARE_VARIABLE), unless you set one
        env = {**os.environ, "CTXRL_GPU_SHARE": os.environ.get("CTXRL_GPU_SHARE", f"{1 / runs:.6g}")}
        with open(log, "w") as handle:  # (the child keeps its own copy of the descriptor)
            procs.append(subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env))
    peaks, total, walls = [0.0] * runs, [0.0], [0.0] * runs

    def wait(i: int) -> None:
        procs[i].wait()
        walls[i] = time.perf_counter() - started

    threads = [threading.Thread(target=sample, args=(procs, peaks, total), daemon=True),
               *(threading.Thread(target=wait, args=(i,), daemon=True) for i in range(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rows = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        row = {"run": i, "rc": p.returncode, "wall_s": round(walls[i], 1), "smi_peak_gib": peaks[i] / 1024 or None,
               **recorded(root / f"run-{i}")}
        if p.returncode != 0:
            row["error"] = last_error(log)
        rows.append(row)
    return rows, total[0]


def table(rows: list[dict]) -> str:
    def cell(value, fmt: str = "{:.2f}") -> str:
        return "-" if value is None else fmt.format(value)

    lines = [f"{'run':>3s} {'rc':>3s} {'wall s':>7s} {'peak GiB':>8s} {'smi GiB':>8s} {'planned GiB':>11s} "
             f"{'budget GiB':>10s} {'KV slots':>8s} {'learner tokens':>14s} {'held-out first → last':>21s}"]
    for r in rows:
        lines.append(f"{r['run']:3d} {r['rc']:3d} {r['wall_s']:7.1f} {cell(r['peak_gib']):>8s} "
                     f"{cell(r['smi_peak_gib']):>8s} {cell(r['planned_gib']):>11s} {cell(r['budget_gib']):>10s} "
                     f"{cell(r['kv_slots'], '{}'):>8s} {cell(r['learner_tokens'], '{}'):>14s} "
                     f"{cell(r.get('heldout_first')):>10s} → {cell(r.get('heldout_last')):<8s}")
        if "error" in r:
            lines.append(f"    {r['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="examples/calculator_tiny.toml", help="TOML config of every run")
    parser.add_argument("--runs", type=int, default=6, help="runs started side by side")
    parser.add_argument("--steps", type=int, default=3, help="RL steps of each run")
    parser.add_argument("--run-root", help="where the run directories go (default: a temporary directory)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="two tiny runs of one step on the CPU: does it run?")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, section.key=value")
    args = parser.parse_intermixed_args(argv)  # (the overrides may follow the options)
    if args.dry_run:
        args.runs, args.steps, args.overrides = 2, 1, [*DRY_RUN, *args.overrides]
    from ctxrl.config import load_config
    from ctxrl.models.loader import parse_tiny
    from ctxrl.train.tiny import ensure_model

    name = load_config(args.config, args.overrides).model.name  # (a config error stops here, once)
    if parse_tiny(name) is not None:  # build (and cache) the tiny model once, not in every run at the same time
        ensure_model(name)
    with tempfile.TemporaryDirectory(prefix="shared_gpu-") as scratch:
        root = Path(args.run_root or scratch)
        root.mkdir(parents=True, exist_ok=True)
        rows, total = run_side_by_side(args.config, args.runs, args.steps, args.overrides, root)
    print(f"{args.runs} runs of {args.config} side by side, {args.steps} steps each, overrides "
          f"{args.overrides or 'none'}; card: {card()}")
    print(table(rows))
    print(f"highest sum of the runs' nvidia-smi figures: {total / 1024:.2f} GiB; "
          f"{sum(r['rc'] == 0 for r in rows)} of {len(rows)} runs finished")
    if args.out:
        Path(args.out).write_text(json.dumps({"card": card(), "rows": rows, "smi_total_peak_gib": total / 1024},
                                             indent=2))
    return rows


if __name__ == "__main__":
    main()
