"""The fast engine's host bookkeeping at a turn boundary, without a GPU: an admission round and the parking after it.

The agentic workload of ``benchmarks/grpo_step.py`` (``--tasks`` x ``--samples`` episodes, ``--turns`` turns: a
``--task-tokens`` prompt shared by a task's samples, ``--turn-tokens`` sampled and ``--obs-tokens`` observed each
turn) runs here through ``SlotTable`` and ``plan_round`` alone, with random ids and no model: each turn plans one
admission round over every episode's next prompt, then parks every slot with the ids it would keep. Both run on
the engine's worker thread between decode chunks, so their time is time the GPU can wait. Reported per turn: the
median milliseconds of the round and of the parking over ``--repeats`` runs, and the prompt tokens the round found
cached. Runs on any machine; compare code versions by running it under each one's ``PYTHONPATH``::

    python benchmarks/engine_host.py
    python benchmarks/engine_host.py --tasks 2 --samples 2 --turns 2 --repeats 1     # the smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file from anywhere; a ctxrl on PYTHONPATH (another version) comes first
    sys.path.append(str(ROOT))


def one_run(args, seed: int) -> list[dict]:
    from ctxrl.engine.base import SamplingParams
    from ctxrl.engine.fast.admission import plan_round
    from ctxrl.engine.fast.rows import Request
    from ctxrl.engine.fast.slots import SlotTable

    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    n = args.tasks * args.samples

    def ids(k: int) -> list[int]:
        return [rng.randrange(3, 150_000) for _ in range(k)]

    tasks = [ids(args.task_tokens) for _ in range(args.tasks)]
    prompts = [list(tasks[i // args.samples]) for i in range(n)]
    table = SlotTable(n)
    params = SamplingParams(max_new_tokens=args.turn_tokens)
    turns = []
    try:
        for turn in range(args.turns):
            requests = [Request(p, params, loop.create_future(), loop) for p in prompts]
            sampled = [ids(args.turn_tokens) for _ in range(n)]
            t0 = time.perf_counter()
            round_ = plan_round(requests, table)
            plan = time.perf_counter() - t0
            assert not round_.deferred, "every episode must find a slot"
            index = {id(r): i for i, r in enumerate(requests)}
            kept = [(slot, r.prompt_ids + sampled[index[id(r)]][:-1]) for r, slot in zip(round_.requests, round_.slots)]
            t0 = time.perf_counter()
            for slot, held in kept:
                table.park(slot, held)
            park = time.perf_counter() - t0
            turns.append({"turn": turn, "plan_ms": plan * 1e3, "park_ms": park * 1e3, "reused": round_.reused,
                          "prompt_tokens": sum(len(p) for p in prompts)})
            prompts = [p + sampled[i] + ids(args.obs_tokens) for i, p in enumerate(prompts)]
    finally:
        loop.close()
    return turns


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--task-tokens", type=int, default=128)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--obs-tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    args = ap.parse_args(argv)
    runs = [one_run(args, seed) for seed in range(args.repeats)]
    rows = []
    for turn in range(args.turns):
        of = [run[turn] for run in runs]
        rows.append({"turn": turn, "plan_ms": round(statistics.median(r["plan_ms"] for r in of), 2),
                     "park_ms": round(statistics.median(r["park_ms"] for r in of), 2),
                     "reused": of[0]["reused"], "prompt_tokens": of[0]["prompt_tokens"]})
    import ctxrl

    report = {"ctxrl": str(Path(ctxrl.__file__).parent), "python": sys.version.split()[0], "args": vars(args) | {
        "out": str(args.out) if args.out else None}, "turns": rows}
    print(f"{args.tasks * args.samples} episodes, medians of {args.repeats} runs (ctxrl from {report['ctxrl']})")
    print(f"{'turn':>4} {'plan ms':>8} {'park ms':>8} {'prompt tokens':>14} {'reused':>8}")
    for r in rows:
        print(f"{r['turn']:>4} {r['plan_ms']:>8.2f} {r['park_ms']:>8.2f} {r['prompt_tokens']:>14} {r['reused']:>8}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
