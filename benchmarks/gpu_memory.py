"""GPU memory of a warm start + RL steps, with cuDNN attention allowed vs kept off (ctxrl.models.kernels).

Each mode runs in its own process: the demo pipeline (``ctxrl.train.trainer.train``) on one
environment with a short warm start and a few RL steps. The parent samples the process's device
memory with ``nvidia-smi`` (which sees what PyTorch's allocator does not: CUDA context, cuDNN and
cuBLAS workspaces) and the child reports PyTorch's own peaks and the wall time::

    python benchmarks/gpu_memory.py --env search_qa sft.demos=2000 train.steps=5

Needs a CUDA GPU and ``nvidia-smi`` for the figures; on a machine without them it still runs
(memory columns read 0), which is what ``--smoke`` (the random-init model, one step, CPU) checks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

MODEL = "tiny:envs=calculator+python_math+search_qa+sokoban"
MODES = {"cudnn-allowed": True, "cudnn-off": False}


def child(mode: str, env: str, model: str, overrides: list[str], run_dir: Path) -> dict:
    import torch

    import ctxrl.models.kernels as kernels
    from ctxrl.config import load_config
    from ctxrl.train.trainer import train

    kernels.ALLOW_CUDNN_ATTENTION = MODES[mode]
    config = load_config(None, [f"model.name={model}", f"env.name={env}", "run.progress=false", "sft.epochs=1",
                                "train.steps=5", "eval.tasks=20", "rollout.max_total_tokens=1024", *overrides])
    started = time.perf_counter()
    summary = train(config, run_dir)
    cuda = torch.cuda.is_available()
    return {"mode": mode, "wall_seconds": round(time.perf_counter() - started, 1),
            "torch_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "torch_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
            "heldout_after": summary["heldout_success_after"]}


def device_memory_mib(pid: int) -> float:
    """This process's device memory as nvidia-smi reports it (0 before it has a context)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
    except FileNotFoundError:  # no NVIDIA driver on this machine
        return 0.0
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return float(fields[1])
    return 0.0


SMOKE = ["sft.demos=4", "sft.batch_size=4", "train.steps=1", "eval.tasks=2", "rollout.tasks_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=8", "model.device=cpu"]


def sample_peak(proc: subprocess.Popen, peak: list[float]) -> None:
    """Keep the highest device memory ``proc`` uses in ``peak[0]`` until it exits."""
    while proc.poll() is None:
        peak[0] = max(peak[0], device_memory_mib(proc.pid))
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="search_qa")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--out", default="runs/gpu_memory")
    parser.add_argument("--smoke", action="store_true", help="seconds on the CPU: random-init model, one step")
    parser.add_argument("--one", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.env, args.overrides = "tiny:pretrain_steps=0", "calculator", [*SMOKE, *args.overrides]
    out = Path(args.out)
    if args.one:
        print(json.dumps(child(args.one, args.env, args.model, args.overrides, out / args.one)))
        return []
    from ctxrl.train.tiny import ensure_model

    ensure_model(args.model)  # build (and cache) the model before either mode runs
    rows = []
    for mode in MODES:
        proc = subprocess.Popen([sys.executable, __file__, "--one", mode, "--env", args.env, "--model", args.model,
                                 "--out", str(out), *args.overrides], stdout=subprocess.PIPE, text=True)
        peak = [0.0]
        sampler = threading.Thread(target=sample_peak, args=(proc, peak), daemon=True)
        sampler.start()
        stdout, _ = proc.communicate()
        sampler.join()
        if proc.returncode != 0:
            raise SystemExit(f"{mode} failed (exit {proc.returncode})")
        row = json.loads(stdout.strip().splitlines()[-1])
        row["nvidia_smi_peak_gib"] = peak[0] / 1024
        rows.append(row)
    print(f"env {args.env}, model {args.model}, overrides {args.overrides or 'none'}")
    print(f"{'mode':14s} {'smi peak GiB':>12s} {'torch reserved':>14s} {'torch alloc':>11s} {'wall s':>7s} "
          f"{'heldout':>7s}")
    for r in rows:
        print(f"{r['mode']:14s} {r['nvidia_smi_peak_gib']:12.2f} {r['torch_peak_reserved_gib']:14.2f} "
              f"{r['torch_peak_allocated_gib']:11.2f} {r['wall_seconds']:7.1f} {r['heldout_after']:7.2f}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
