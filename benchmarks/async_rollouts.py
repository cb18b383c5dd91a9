"""Asynchronous against synchronous rollouts on Ray, with a slow tool: steps per second and reward.

The calculator environment with every tool call taking ``--latency`` seconds (as a search, a
sandbox or a container would), rollouts on Ray (``distributed.rollout_workers`` actors), the
same settings in both arms (the decoupled objective, ``algo.old_logprobs = "recompute"``, in
both) except ``distributed.max_staleness``: 0 (synchronous) or 1 (the next step's rollouts run
while this step trains). Each arm runs the whole pipeline (warm start, RL, evaluation) on the same
seeds; the table gives the median RL step time (after the first), episodes per second, and the
training reward and held-out success after the same number of episodes.

    python benchmarks/async_rollouts.py --steps 12 --latency 0.2
    python benchmarks/async_rollouts.py --smoke          # the random tiny model, 2 steps: does it run?
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ctxrl.envs.calculator import CalculatorEnv

HERE = Path(__file__).resolve().parent


class SlowCalculator(CalculatorEnv):
    """The calculator environment, each tool call taking ``latency_s`` seconds."""

    latency_s = float(os.environ.get("CTXRL_SLOW_TOOL_S", "0.2"))  # (Ray actors get it from the benchmark)

    async def step(self, message):
        if message.tool_calls:
            await asyncio.sleep(self.latency_s)
        return await super().step(message)


def run_arm(staleness: int, args, run_dir: Path) -> dict:
    from ctxrl.config import load_config
    from ctxrl.train.trainer import train

    overrides = ["env.name=async_rollouts:SlowCalculator", "distributed.backend=ray",
                 f"distributed.rollout_workers={args.workers}", f"distributed.max_staleness={staleness}",
                 "algo.old_logprobs=recompute", "algo.tis_cap=2.0", f"train.steps={args.steps}",
                 f"eval.tasks={args.eval_tasks}", "run.progress=false", f"run.seed={args.seed}",
                 f"rollout.tasks_per_step={args.tasks_per_step}", f"rollout.group_size={args.group_size}",
                 *args.overrides]
    if args.smoke:
        overrides += ["model.name=tiny:pretrain_steps=0", "sft.enabled=false", "rollout.max_new_tokens=8"]
    start = time.perf_counter()
    summary = train(load_config(None, overrides), run_dir)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    step_s = statistics.median([r["time_step"] for r in rl[1:]] or [r["time_step"] for r in rl])
    episodes = len(rl) * args.tasks_per_step * args.group_size
    last = rl[-max(1, len(rl) // 3):]
    return {"arm": "async" if staleness else "sync", "max_staleness": staleness, "steps": len(rl),
            "step_s": round(step_s, 3), "episodes_per_s": round(episodes / sum(r["time_step"] for r in rl), 2),
            "reward_last_third": round(statistics.mean(r["reward"] for r in last), 3),
            "staleness_max": max(r.get("staleness_max", 0.0) for r in rl),
            "heldout_after": summary.get("heldout_success_after"), "wall_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--latency", type=float, default=0.2, help="seconds per tool call")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--eval-tasks", type=int, default=40)
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", help="JSON file for the rows")
    ap.add_argument("overrides", nargs="*", help="config overrides for both arms")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_tasks, args.latency, args.tasks_per_step, args.group_size = 2, 2, 0.01, 2, 2
    SlowCalculator.latency_s = args.latency
    import ray

    # The actors import this module by name (env.name = async_rollouts:SlowCalculator).
    path = f"{HERE}:{HERE.parent}"
    ray.init(num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": path, "CTXRL_SLOW_TOOL_S": str(args.latency)}})
    sys.path[:0] = [str(HERE)]
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for staleness in (0, 1):
                rows.append(run_arm(staleness, args, Path(tmp) / f"eta{staleness}"))
    finally:
        ray.shutdown()
    print(f"\ncalculator, tool latency {args.latency:g} s, {args.workers} Ray rollout workers, {args.steps} steps")
    print(f"{'arm':6s} {'eta':>3s} {'step s':>7s} {'ep/s':>6s} {'reward (last third)':>20s} {'held-out':>9s} "
          f"{'max staleness':>13s}")
    for r in rows:
        print(f"{r['arm']:6s} {r['max_staleness']:3d} {r['step_s']:7.2f} {r['episodes_per_s']:6.2f} "
              f"{r['reward_last_third']:20.3f} {r['heldout_after']!s:>9s} {r['staleness_max']:13.0f}")
    print(f"async / sync step time: {rows[0]['step_s'] / rows[1]['step_s']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
