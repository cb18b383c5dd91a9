"""Whether two runs of ``ctxrl demo`` gave the same figures: a redesign that changes no behaviour must leave them
exactly as they were (issue 50; the CPU demo is deterministic).

    ctxrl demo --steps 10 --json --run-dir AFTER                            # on the change
    .venv/bin/python benchmarks/demo_figures.py BEFORE AFTER                # exit 0: the same figures
    .venv/bin/python benchmarks/demo_figures.py RUN --save figures.json     # a run's figures, to compare later

BEFORE and AFTER are run directories, or the figures of one saved with ``--save``
(``benchmarks/results/demo-cpu2-50-before.json``: the demo before issue 50's redesign). Two runs give the same
figures when every row of their ``metrics.jsonl`` holds the same values (the wall-clock keys, ``WALL``, left out)
and their final weights (``checkpoints/final/model.safetensors``, or a LoRA run's ``adapter_model.safetensors``)
are the same bytes. This is stricter than the two decimals of the demo's table: a change in the seventh digit of a
loss, or in one weight, is a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

WALL = frozenset({"seconds", "time_rollout", "time_step", "time_update"})
"""Keys of a metrics row that measure wall-clock time, which no two runs share."""
WEIGHTS = ("model.safetensors", "adapter_model.safetensors")


def figures(run: Path) -> dict:
    """``{"rows": metrics.jsonl's rows without their wall-clock keys, "weights_sha256": the final weights' hash (None
    when the run saved none)}`` of a run directory, or as saved in a JSON file by ``--save``."""
    if run.is_file():
        return json.loads(run.read_text())
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [{k: v for k, v in json.loads(line).items() if k not in WALL} for line in lines if line.strip()]
    found = [run / "checkpoints" / "final" / name for name in WEIGHTS]
    sha = next((hashlib.sha256(p.read_bytes()).hexdigest() for p in found if p.is_file()), None)
    return {"rows": rows, "weights_sha256": sha}


def differences(before: dict, after: dict) -> list[str]:
    """What differs between two runs' ``figures``, one line each (empty: the same figures)."""
    a, b = before["rows"], after["rows"]
    out = [f"metrics.jsonl has {len(a)} rows before and {len(b)} after"] if len(a) != len(b) else []
    for i, (x, y) in enumerate(zip(a, b)):
        out += [f"row {i} {key}: {x.get(key)!r} -> {y.get(key)!r}" for key in sorted(set(x) | set(y))
                if x.get(key) != y.get(key)]
    if before["weights_sha256"] != after["weights_sha256"]:
        out.append(f"final weights: sha256 {before['weights_sha256']} -> {after['weights_sha256']}")
    return out


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the demo's run directory (or saved figures) before the change")
    parser.add_argument("after", type=Path, nargs="?", help="the same after it")
    parser.add_argument("--save", type=Path, metavar="OUT.json", help="write BEFORE's figures to this file")
    args = parser.parse_args(argv)
    before = figures(args.before)
    if args.save:
        args.save.write_text(json.dumps(before, indent=1) + "\n")
    if args.after is None:
        return []
    found = differences(before, figures(args.after))
    print(f"{len(before['rows'])} metrics rows; final weights sha256 {before['weights_sha256']}")
    print("the same figures" if not found else f"{len(found)} differences:")
    for line in found[:40]:
        print(f"  {line}")
    return found


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
