"""Choose issue49c.toml's warm-start size from issue49c-cal.toml's step-0 evaluations, on the card, before the batch.

    python3 experiments/device/choose_demos.py CALIBRATION_DIR experiments/plans/issue49c.toml

Reads each calibration run's held-out success after its warm start (``fh135-b1-s0-summarize384-calN``: N of the
environment's own summarize demos; they ran on 2026-11-29 as ``fh135-cal-ownN``), prints them, and writes into the
plan's ``demos`` var the N whose success is nearest 0.30 among those in [0.05, 0.75]: a warm start that reaches some
3-4 page trails and leaves room to improve. When none is in that range it takes the N nearest 0.30 all the same (on
2026-11-29 the sizes gave 0.00, 0.00, 0.02 and 1.00: 128). An earlier rule took the smallest N there, which gave
0.00 and was overruled by hand.
Imports nothing from ctxrl (it runs beside a batch, with the card's plain python3).
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

TARGET, LOW, HIGH = 0.30, 0.05, 0.75


def heldout_at_start(run: Path) -> float | None:
    """The held-out success of a run's step-0 evaluation, or None when it has none yet."""
    for path in sorted(run.glob("*/metrics.jsonl*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as rows:
            for line in rows:
                row = json.loads(line)
                if row.get("phase") == "eval" and row.get("split") == "heldout" and row.get("step") == 0:
                    return float(row["success"])
    return None


def choose(successes: dict[int, float]) -> int:
    """The demo count to use, by the rule in the module's docstring."""
    if not successes:
        raise SystemExit("no calibration run has a step-0 held-out evaluation: nothing to choose from")
    inside = {n: s for n, s in successes.items() if LOW <= s <= HIGH}
    if inside:
        return min(inside, key=lambda n: (abs(inside[n] - TARGET), n))
    return min(successes, key=lambda n: (abs(successes[n] - TARGET), n))


def main(argv: list[str]) -> int:
    calibration, plan = Path(argv[0]), Path(argv[1])
    successes = {}
    for run in sorted((calibration / "runs").glob("fh135-b1-s0-summarize384-cal*")):
        value = heldout_at_start(run)
        print(f"{run.name}: held-out success after the warm start {value}")
        if value is not None:
            successes[int(run.name.rsplit("-cal", 1)[1])] = value
    chosen = choose(successes)
    text, count = re.subn(r'^demos = "\d+"$', f'demos = "{chosen}"', plan.read_text(), flags=re.M)
    if count != 1:
        raise SystemExit(f"{plan}: expected one line 'demos = \"N\"' in [vars], found {count}")
    plan.write_text(text)
    print(f"chosen: sft.demos={chosen} (written to {plan})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
