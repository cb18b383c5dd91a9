"""Scripted ceilings of context managers over budgets: which comparisons a task allows before any model trains.

For each manager and budget, the environment's scripted solution is played under the manager with its scripted side
requests (``ctxrl.demos.ceiling``): the fraction of held-out tasks whose answer's facts are still in the context the
answer is written from, the peak working context, and the fraction the budget cut short. A manager at 0.00 cannot
win at that budget by construction; two managers are fairly compared only where the baseline's ceiling is above 0.
No model is loaded (only its tokenizer and chat template), so it runs on a CPU in seconds::

    python experiments/ceilings.py --env fact_hunt --model smollm2-135m-instruct \\
        --managers window,summarize,select,fold --budgets 384,416,456,480,512,576,640,672 --out ceilings.json

``experiments/tables.py ceilings ceilings.json`` prints the table the docs quote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The rollout settings of the issue-49 plan (experiments/plans/issue49.toml), which the budgets are meant for.
DEFAULTS = ["env.max_turns=6", "rollout.max_total_tokens=1024", "rollout.max_new_tokens=64",
            *(f"context.{manager}.{key}=4" for manager in ("summarize", "select")
              for key in ("max_summaries", "eval_max_summaries"))]


def sweep(env: str, model: str, managers: list[str], budgets: list[int], tasks: int,
          overrides: list[str]) -> list[dict]:
    """One record per (manager, budget): the scripted ceiling's figures, with the settings that produced them."""
    from ctxrl.config import ConfigError, load_config
    from ctxrl.demos.ceiling import scripted_ceiling
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_env_class, spec_renderer

    records, renderer = [], None
    for manager in managers:
        for budget in budgets if manager != "full" else [0]:
            settings = [f"model.name={model}", f"env.name={env}", *DEFAULTS, f"context.manager={manager}",
                        f"context.max_context_tokens={budget}", *overrides]
            try:
                spec = RolloutSpec.from_config(load_config(None, settings))
            except ConfigError as exc:
                records.append({"manager": manager, "budget": budget, "error": str(exc)})
                continue
            renderer = renderer or spec_renderer(spec)
            figures = scripted_ceiling(spec_env_class(spec), renderer, spec.eval, tasks)
            records.append({"env": env, "model": model, "manager": manager, "budget": budget or None,
                            "overrides": [*DEFAULTS, *overrides], **figures})
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="fact_hunt")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer and template count tokens")
    parser.add_argument("--managers", default="full,window,summarize,select,fold")
    parser.add_argument("--budgets", default="384,416,456,480,512,576,640,672")
    parser.add_argument("--tasks", type=int, default=60, help="held-out tasks played per setting")
    parser.add_argument("--out", type=Path, help="write the records here (JSON)")
    parser.add_argument("overrides", nargs="*", help="more config overrides, section.key=value")
    args = parser.parse_args(argv)
    records = sweep(args.env, args.model, args.managers.split(","), [int(b) for b in args.budgets.split(",")],
                    args.tasks, args.overrides)
    for r in records:
        if "error" in r:
            print(f"{r['manager']:10s} {r['budget']:5d}  {r['error']}")
        else:
            print(f"{r['manager']:10s} {r['budget'] or '-':>5}  ceiling {r['ceiling']:.2f}  "
                  f"peak {r['peak_context_max']:4d}  cut short {r['cut_short']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
