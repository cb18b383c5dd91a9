"""Which reasoning-gym families pass ``check-env`` as ``reasoning_gym:NAME``, and their context ranges: the docs table.

For each family (every one reasoning-gym registers, ``composite`` aside, unless ``--families`` names some) it runs
ctxrl's conformance suite (``ctxrl.envs.check_env``: seeded sampling of the three splits, train and heldout
disjoint, ood contexts past the train ranges, the gold solution scoring 1 on every split) with a deadline, in
``--jobs`` worker processes that share the families out, and prints a markdown row: the family's context variables
with their train and ood ranges, the verdict (or the first problem), the warnings (levels the family's own check
refuses) and the seconds it took::

    python benchmarks/reasoning_gym_families.py --out families.md   # every family (docs/reasoning-gym.md's table)
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


def check_chunk(families: list[str], tasks: int, timeout: float) -> list[dict]:
    """``check_one`` on each family in turn, each within ``timeout`` seconds (SIGALRM: this process's main thread)."""
    import signal

    def expire(signum, frame):
        raise TimeoutError(f"timed out after {timeout:g} s")

    import reasoning_gym  # noqa: F401 - once, before the clock of the first family starts

    rows = []
    signal.signal(signal.SIGALRM, expire)
    for family in families:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            rows.append(check_one(family, tasks))
        except TimeoutError as exc:  # (check_one reports every other failure itself)
            rows.append({"family": family, "ranges": [], "problems": [str(exc)], "notes": [], "warnings": [],
                         "seconds": timeout})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _in_a_process(families: list[str], tasks: int, timeout: float) -> list[dict]:
    """``check_chunk`` in a child process (one import of reasoning-gym for the whole chunk)."""
    import ctxrl

    here = str(Path(ctxrl.__file__).resolve().parents[1])  # the child imports the ctxrl this process runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, __file__, "--one", ",".join(families), "--tasks", str(tasks),
                           "--timeout", str(timeout)], capture_output=True, text=True, env=env)
    rows = {row["family"]: row for row in map(json.loads, _json_lines(proc.stdout))}
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return [rows.get(f) or {"family": f, "ranges": [], "problems": [f"exit {proc.returncode}: {tail}"], "notes": [],
                            "warnings": [], "seconds": 0.0} for f in families]


def _json_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("{")]


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
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: check these families, a JSON line each
    args = parser.parse_args(argv)
    if args.one:
        return check_chunk(args.one.split(","), args.tasks, args.timeout)
    if args.smoke:
        rows = [check_one(family, 2) for family in SMOKE]
    else:
        if args.families:
            families = [f.strip() for f in args.families.split(",") if f.strip()]
        else:
            from reasoning_gym.factory import DATASETS

            families = sorted(name for name in DATASETS if name != "composite")
        jobs = max(1, min(args.jobs, len(families)))
        chunks = [families[i::jobs] for i in range(jobs)]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            done = {row["family"]: row for chunk in pool.map(lambda c: _in_a_process(c, args.tasks, args.timeout),
                                                              chunks) for row in chunk}
        rows = [done[f] for f in families]
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return rows


if __name__ == "__main__":
    main()
