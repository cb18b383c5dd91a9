"""Check a plan's comparisons before any GPU time is spent: could the baseline have won, is the control a control?

A plan (``experiments/batch.py``) may name the comparisons its runs exist for::

    [[compare]]
    claim = "summarize beats a window matched on peak context (SUPO, ReSum)"
    arm = "fh135-b0-s{seed}-summarize384-fmt"          # run names; {seed} takes each of seeds
    baseline = "fh135-b0-s{seed}-window544-fmt"
    control = "fh135-b0-s{seed}-summarize384-fmt-sftonly"   # optional: the arm's SFT-only control
    seeds = [0, 1, 2, 3, 4]
    peak_matched = true                               # optional: the baseline's budget covers the arm's peak

For each comparison the checker rebuilds the arm's and the baseline's configs from their commands (runs of
``benchmarks/env_training.py``) and refuses it, with exit code 2 and one line saying why, when:

- the baseline (or the arm) cannot win **by construction**: its scripted ceiling is 0.00 (``ctxrl.demos.ceiling``:
  the environment's scripted solution played under the manager at its budget never keeps the facts its answer
  needs, as ``window`` at 384 tokens on ``fact_hunt``);
- with ``--pilot RECORDS`` (``experiments/tables.py collect`` of a pilot batch), the baseline's held-out success
  after the warm start was 0.00 or 1.00 on every seed: the warm start decided the comparison before RL began;
- ``control`` is not the arm with ``train.objective=sft`` and nothing else changed but ``train.lr`` (the same warm
  start);
- the seeds are not the same in every arm, one seed's arms evaluate different held-out tasks (they pair by task),
  or every seed evaluates the same held-out tasks (``eval.seed`` must vary with the seed, so that the interval
  covers task sampling too);
- ``peak_matched`` and the baseline's budget is below the arm's scripted peak working context.

It prints each comparison's ceilings and peaks. Ceilings are the managers' mechanics with perfect scripted side
requests, an upper bound, not a prediction (a window policy may guess an answer it cannot see).

    python experiments/plan_check.py experiments/plans/issue49.toml [--tasks 60] [--pilot runs.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import PLACEHOLDER, PlanError, load_plan  # noqa: E402  (a sibling script, not a package)

ROOT = Path(__file__).resolve().parents[1]
IGNORED_IN_CONTROL = {("train", "objective"), ("train", "lr"), ("run", "name")}
"""Where a control may differ from its arm: its objective, and the rate it trains at (a plan may run a control at
RL's rate and one at the warm start's, and report the stronger)."""


def _env_training():
    spec = importlib.util.spec_from_file_location("env_training", ROOT / "benchmarks" / "env_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_overrides(argv: list[str], name: str) -> list[str]:
    """The config overrides of a plan run's command (a ``benchmarks/env_training.py`` run of one env and seed)."""
    if len(argv) < 2 or not argv[1].endswith("env_training.py"):
        raise PlanError(f"run {name}: plan_check reads runs of benchmarks/env_training.py, not {argv[1:2]}")
    env_training = _env_training()
    args = env_training.build_parser().parse_args(argv[2:])
    if len(args.env or []) != 1 or len(args.seed or [0]) != 1:
        raise PlanError(f"run {name}: a compared run plays one --env and one --seed")
    return env_training.run_overrides(args.env[0], (args.seed or [0])[0], args.model, args.steps, args.overrides)


def load_comparisons(path: Path, settings: dict[str, str] | None = None) -> tuple[list[dict], dict[str, list[str]]]:
    """(the plan's ``[[compare]]`` entries, every run's config overrides by name); errors name the entry."""
    jobs = load_plan(path, Path("runs/plan-check"), settings=settings)
    argv = {j.name: j.argv for j in jobs if j.kind == "run"}
    plan = tomllib.loads(path.read_text())
    comparisons = plan.get("compare", [])
    if not comparisons:
        raise PlanError(f"{path}: no [[compare]] entries to check")
    needed: dict[str, list[str]] = {}
    for i, c in enumerate(comparisons):
        where = f"{path}: [[compare]] #{i + 1}"
        for key in ("claim", "arm", "baseline", "seeds"):
            if key not in c:
                raise PlanError(f"{where} needs {key!r}")
        unknown = set(c) - {"claim", "arm", "baseline", "control", "seeds", "peak_matched"}
        if unknown:
            raise PlanError(f"{where}: unknown keys {sorted(unknown)}")
        if not c["seeds"] or not all(isinstance(s, int) for s in c["seeds"]):
            raise PlanError(f"{where}: seeds must be a list of integers")
        for role in ("arm", "baseline", "control"):
            if role not in c:
                continue
            if "{seed}" not in c[role]:
                raise PlanError(f"{where}: {role} = {c[role]!r} must contain {{seed}}: the same seeds in every arm")
            if set(PLACEHOLDER.findall(c[role])) - {"seed"}:
                raise PlanError(f"{where}: {role} may use only the {{seed}} placeholder")
            for seed in c["seeds"]:
                name = c[role].format(seed=seed)
                if name not in argv:
                    raise PlanError(f"{where}: {role} run {name!r} is not in the plan")
                needed[name] = run_overrides(argv[name], name)
    return comparisons, needed


def _config_table(overrides: list[str]) -> dict:
    from ctxrl.config import load_config

    return dataclasses.asdict(load_config(None, overrides))


def control_difference(arm: list[str], control: list[str]) -> list[str]:
    """Where the control's config differs from the arm's besides ``IGNORED_IN_CONTROL``, and whether it is the SFT-only
    objective: an empty list when it is the arm's exact SFT-only control."""
    a, c = _config_table(arm), _config_table(control)
    problems = [] if c["train"]["objective"] == "sft" else ["train.objective is not sft"]
    for section, fields in a.items():
        if not isinstance(fields, dict):
            continue
        for key, value in fields.items():
            if (section, key) not in IGNORED_IN_CONTROL and c[section].get(key) != value:
                problems.append(f"{section}.{key}: {value!r} in the arm, {c[section].get(key)!r} in the control")
    return problems


def ceiling(overrides: list[str], tasks: int) -> dict:
    """The scripted ceiling (``ctxrl.demos.ceiling``) of a run's environment, manager and budget on held-out tasks."""
    from ctxrl.config import load_config
    from ctxrl.demos.ceiling import scripted_ceiling
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_env_class, spec_renderer

    spec = RolloutSpec.from_config(load_config(None, overrides))
    return scripted_ceiling(spec_env_class(spec), spec_renderer(spec), spec.eval, tasks, split="heldout")


def pilot_warm_start(records: list[dict], name_pattern: str, seeds: list[int]) -> list[float]:
    """The held-out success after the warm start of the pilot's runs named ``name_pattern`` for ``seeds``."""
    names = {name_pattern.format(seed=s) for s in seeds}
    return [r["heldout_before"] for r in records if r.get("name") in names and r.get("heldout_before") is not None]


def check(comparison: dict, configs: dict[str, list[str]], *, tasks: int, pilot: list[dict] | None,
          ceilings: dict) -> list[str]:
    """Why ``comparison`` must not run (empty: it may), filling ``ceilings`` with what it measured."""
    seeds = comparison["seeds"]
    first = {role: configs[comparison[role].format(seed=seeds[0])] for role in ("arm", "baseline")}
    problems = []
    for role, overrides in first.items():
        key = comparison[role]
        if key not in ceilings:
            ceilings[key] = ceiling(overrides, tasks)
        if ceilings[key]["ceiling"] == 0.0:
            problems.append(f"the {role} ({key}) cannot win by construction: its scripted ceiling on {tasks} held-out "
                            "tasks is 0.00 (no scripted play keeps the answer's facts to the end)")
    if comparison.get("peak_matched"):
        from ctxrl.config import load_config

        budget = load_config(None, first["baseline"]).context.max_context_tokens
        peak = ceilings[comparison["arm"]]["peak_context_max"]
        if budget < peak:
            problems.append(f"peak_matched: the baseline's budget {budget} is below the arm's scripted peak working "
                            f"context {peak}; give it at least {peak}")
    for seed in seeds:
        if "control" in comparison:
            arm, control = comparison["arm"].format(seed=seed), comparison["control"].format(seed=seed)
            difference = control_difference(configs[arm], configs[control])
            if difference:
                problems.append(f"{control} is not the SFT-only control of {arm}: {'; '.join(difference)}")
    from ctxrl.config import load_config

    for seed in seeds:  # per-task outcomes pair by task id only within one draw of tasks
        draws = {role: load_config(None, configs[comparison[role].format(seed=seed)]).eval.seed
                 for role in ("arm", "baseline", "control") if role in comparison}
        if len(set(draws.values())) > 1:
            problems.append(f"seed {seed}: the arms evaluate different held-out tasks (eval.seed {draws}); give them "
                            "the same eval.seed, so that tasks pair")
    if len(seeds) > 1:
        eval_seeds = {load_config(None, configs[comparison["arm"].format(seed=s)]).eval.seed for s in seeds}
        if len(eval_seeds) == 1:
            problems.append("every seed evaluates the same held-out tasks: set eval.seed per seed (e.g. 1234 + seed) "
                            "so that intervals cover task sampling")
    if pilot is not None:
        before = pilot_warm_start(pilot, comparison["baseline"], seeds)
        if before and all(b in (0.0, 1.0) for b in before) and len(set(before)) == 1:
            problems.append(f"in the pilot the baseline's held-out success after the warm start was {before[0]:.2f} "
                            f"on every seed ({len(before)}): the warm start decided it before RL")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--tasks", type=int, default=60, help="held-out tasks the scripted ceilings play")
    parser.add_argument("--pilot", type=Path, help="records of a pilot batch (experiments/tables.py collect)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="replace a [vars] or [models] entry (as experiments/batch.py run --set)")
    args = parser.parse_args(argv)
    try:
        settings = dict(s.split("=", 1) for s in args.set)
        comparisons, configs = load_comparisons(args.plan, settings)
    except (PlanError, ValueError) as exc:
        print(f"plan_check: {exc}", file=sys.stderr)
        return 2
    pilot = json.loads(args.pilot.read_text()) if args.pilot else None
    ceilings: dict[str, dict] = {}
    refused = 0
    for c in comparisons:
        problems = check(c, configs, tasks=args.tasks, pilot=pilot, ceilings=ceilings)
        print(c["claim"])
        for role in ("arm", "baseline"):
            r = ceilings[c[role]]
            print(f"  {role:8s} {c[role]}: ceiling {r['ceiling']:.2f}, peak context {r['peak_context_mean']:.0f} mean "
                  f"/ {r['peak_context_max']} max, cut short {r['cut_short']:.2f}")
        for problem in problems:
            print(f"  REFUSED: {problem}")
        refused += bool(problems)
    print(f"{len(comparisons) - refused} of {len(comparisons)} comparisons may run")
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
