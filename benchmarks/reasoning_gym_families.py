"""Which reasoning-gym families pass ``check-env`` as ``reasoning_gym:NAME``, and their context ranges: the docs table.

For each family (every one reasoning-gym registers, ``composite`` aside, unless ``--families`` names some) it runs
ctxrl's conformance suite (``ctxrl.envs.check_env``: seeded sampling of the three splits, train and heldout
disjoint, ood contexts past the train ranges, the gold solution scoring 1 on every split) in a process of its own
with a deadline, and prints a markdown row: the family's context variables with their train and ood ranges, the
verdict (or the first problem), the warnings (levels the family's own check refuses) and the seconds it took::

    python benchmarks/reasoning_gym_families.py --out docs/reasoning-gym-families.md   # every family
    python benchmarks/reasoning_gym_families.py --families chain_sum,leg_counting --tasks 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SMOKE = ("chain_sum", "leg_counting")


def check_one(family: str, tasks: int) -> dict:
    """``check_env`` on ``reasoning_gym:FAMILY`` (in this process): its ranges, problems and warnings."""
    import warnings

    from ctxrl.envs import check_env
    from ctxrl.envs.registry import get_env_class

    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cls = get_env_class(f"reasoning_gym:{family}")
            ranges = [_range(row) for row in cls.context_space.describe()[1:]]
            notes: list[str] = []
            problems = check_env(cls, n_tasks=tasks, notes=notes)
        except Exception as exc:  # noqa: BLE001 - a family that cannot be built is a row, not a crash
            ranges, notes, problems = [], [], [f"{type(exc).__name__}: {exc}"]
    return {"family": family, "ranges": ranges, "problems": problems, "notes": notes,
            "warnings": [str(w.message) for w in caught if "reasoning_gym" in str(w.message)],
            "seconds": time.perf_counter() - started}


def _range(row: dict) -> str:
    train, ood = "{}..{}".format(*row["train"]), "{}..{}".format(*row["ood"])
    return f"`{row['name']}` {train} / {ood if row['ood'] != row['train'] else '-'}"


def _in_a_process(family: str, tasks: int, timeout: float) -> dict:
    import ctxrl

    here = str(Path(ctxrl.__file__).resolve().parents[1])  # the child imports the ctxrl this process runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    try:
        proc = subprocess.run([sys.executable, __file__, "--one", family, "--tasks", str(tasks)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"family": family, "ranges": [], "problems": [f"timed out after {timeout:g} s"], "notes": [],
                "warnings": [], "seconds": timeout}
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"family": family, "ranges": [], "problems": [f"exit {proc.returncode}: {tail}"], "notes": [],
                "warnings": [], "seconds": 0.0}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| family | context: train / ood | check-env | seconds |", "|---|---|---|---|"]
    for row in rows:
        if row["problems"]:
            problem = row["problems"][0]
            if problem.startswith("gold solution on"):  # (it quotes the whole prompt before the reason)
                problem = "gold solution: " + problem.rsplit("): ", 1)[-1]
            verdict = "fails: " + problem.replace("|", "\\|").replace("\n", " ")[:300]
        else:
            verdict = "OK" + (" (no ood)" if any("'ood'" in n for n in row["notes"]) else "")
        if row["warnings"]:
            verdict += "; " + "; ".join(w.split(": ", 1)[1] for w in row["warnings"])
        ranges = ", ".join(row["ranges"]) or "none"
        lines.append(f"| `{row['family']}` | {ranges} | {verdict} | {row['seconds']:.0f} |")
    passed = sum(not row["problems"] for row in rows)
    return "\n".join(lines) + f"\n\n{passed} of {len(rows)} families pass.\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated families (default: all but composite)")
    parser.add_argument("--tasks", type=int, default=4, help="tasks per split for check_env (default 4)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a family may take (default 300)")
    parser.add_argument("--jobs", type=int, default=2, help="families checked at once (default 2)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--smoke", action="store_true", help=f"{', '.join(SMOKE)} with 2 tasks, in this process")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: check one family, print its row as JSON
    args = parser.parse_args(argv)
    if args.one:
        row = check_one(args.one, args.tasks)
        print(json.dumps(row))
        return [row]
    if args.smoke:
        rows = [check_one(family, 2) for family in SMOKE]
    else:
        if args.families:
            families = [f.strip() for f in args.families.split(",") if f.strip()]
        else:
            from reasoning_gym.factory import DATASETS

            families = sorted(name for name in DATASETS if name != "composite")
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            rows = list(pool.map(lambda f: _in_a_process(f, args.tasks, args.timeout), families))
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return rows


if __name__ == "__main__":
    main()
