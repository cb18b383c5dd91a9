"""The seed papers' claims against ctxrl's records: the page ``docs/experiments/README.md`` (``experiments/tables.py
claims experiments/claims.toml --write``).

``experiments/claims.toml`` names, for each claim, the records that test it, the contrast (an arm against a baseline
arm or field, under filters), the paper's figure, the goal and the 'why'. For each claim this module computes
ctxrl's figure with its two-level bootstrap interval and n (``experiments/stats.py``), RL's share over the SFT-only
control where one ran (``train.objective = "sft"``), the paired t-test and the sign-flip test, and the verdict
(``stats.verdict``, held to ``at_most`` where the claim says the records show more than the figure), and writes the
page. Records are read with ``experiments/tables.py``'s ``load_records``.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import (  # noqa: E402  (siblings, not a package)
    CONFIDENCE,
    DIRECTIONS,
    MAX_SIGN_FLIP_SEEDS,
    RESAMPLES,
    RESULT_SEEDS,
    Interval,
    SeedOutcome,
    bootstrap_contrast,
    bootstrap_difference,
    paired_t_test,
    seed_differences,
    sign_flip_floor,
    sign_flip_p,
    verdict,
)
from tables import _where, load_records, task_outcomes  # noqa: E402

CLAIM_KEYS = {"name": None, "paper": None, "records": None, "kind": None, "arm": None, "field": None,
              "direction": None, "why": None, "baseline": "", "baseline_field": "", "where": {},
              "baseline_where": {}, "control_where": {}, "goal": 0.0, "relative": False, "at_most": ""}
VERDICT_ORDER = ("not run", "no interval", "not reproduced", "no control", "direction only", "reproduced")
"""Verdicts from the weakest to the strongest, for a claim's ``at_most``: a verdict its 'why' caps (a gain that a
baseline matched, a shortcut) whatever the numbers' rule gives."""


class ClaimError(ValueError):
    """A claims file that cannot be read as written: the message names the claim and what to fix."""


def claim_settings(entry: dict, index: int) -> dict:
    """One ``[[claim]]`` of a claims file with its defaults filled in; a missing or unknown key, or a direction
    other than ``up``/``down``/``within``, is a ``ClaimError`` naming the claim."""
    label = f"claim {index + 1} ({entry.get('name', 'no name')})"
    unknown = sorted(set(entry) - set(CLAIM_KEYS))
    missing = sorted(k for k, default in CLAIM_KEYS.items() if default is None and k not in entry)
    if unknown or missing:
        raise ClaimError(f"{label}: " + "; ".join(
            ([f"unknown keys {unknown} (known: {sorted(CLAIM_KEYS)})"] if unknown else []) +
            ([f"missing keys {missing}"] if missing else [])))
    claim = {**CLAIM_KEYS, **entry}
    if claim["direction"] not in DIRECTIONS:
        raise ClaimError(f"{label}: direction {claim['direction']!r}; choose from {', '.join(DIRECTIONS)}")
    claim["baseline"] = claim["baseline"] or claim["arm"]
    claim["baseline_field"] = claim["baseline_field"] or claim["field"]
    if claim["at_most"] and claim["at_most"] not in VERDICT_ORDER:
        raise ClaimError(f"{label}: at_most {claim['at_most']!r}; choose from {', '.join(VERDICT_ORDER)}")
    if (claim["baseline"], claim["baseline_field"], claim["baseline_where"]) == (claim["arm"], claim["field"], {}):
        raise ClaimError(f"{label}: it compares the arm with itself; name a baseline arm, a baseline_field "
                         "(heldout_before: what RL added) or a baseline_where")
    return claim


def _filters(table: dict) -> dict:
    """A claim's record filters as records hold them: ``budget = 0`` is no budget (None), as
    ``context.max_context_tokens = 0`` is."""
    return {k: (None if k == "budget" and v == 0 else v) for k, v in table.items()}


def seed_outcomes(records: list[dict], *, kind: str, arm: str, field: str, where: dict,
                  objective: str) -> dict[tuple[str, int], SeedOutcome]:
    """(build, seed) -> ``field`` of the records of ``kind`` and ``arm`` that match ``where`` and were trained with
    ``objective`` (a record without one is an RL run: the SFT-only control came with issue 49), with the per-task
    outcomes behind it where the record has them. Two records for one build and seed are a ``ClaimError``: the
    filters do not say which run the claim means."""
    chosen = [r for r in _where(records, kind, arm=arm, **where)
              if r.get(field) is not None and (r.get("objective") or "rl") == objective]
    by_seed: dict[tuple[str, int], dict] = {}
    for r in chosen:
        key = (r["build"], r["seed"])
        if key in by_seed:
            raise ClaimError(f"{arm} ({objective}) has two records for {key[0]} seed {key[1]}: "
                             f"{by_seed[key]['name']} and {r['name']}; narrow the claim's filters")
        by_seed[key] = r
    return {key: SeedOutcome(r[field], task_outcomes(r, field), r.get("eval_seed")) for key, r in by_seed.items()}


class ClaimFigures(NamedTuple):
    figure: Interval  # arm − baseline, paired by build and seed
    arm: Interval
    baseline: Interval
    share: Interval | None  # after RL − the SFT-only control; None where no control ran
    differences: list[float]  # arm − baseline per seed, what the paired tests test
    steps: list[int]  # the RL steps the arm's paired runs took (empty where the records do not say)
    t_test: tuple[float, int, float]  # (t, degrees of freedom, two-sided p)
    sign_flip_p: float


def claim_figures(claim: dict, records: list[dict]) -> ClaimFigures:
    """ctxrl's figure for one claim, the two levels it is the difference of, RL's share and the paired tests."""
    where = {"variant": None, **_filters(claim["where"])}  # plain runs unless a variant is named, as ``paired``
    arm = seed_outcomes(records, kind=claim["kind"], arm=claim["arm"], field=claim["field"], where=where,
                        objective="rl")
    baseline = seed_outcomes(records, kind=claim["kind"], arm=claim["baseline"], field=claim["baseline_field"],
                             where={**where, **_filters(claim["baseline_where"])}, objective="rl")
    # a control run cannot share its RL run's name, so it differs in its variant: any variant, unless named
    control_where = {k: v for k, v in where.items() if k != "variant"} | _filters(claim["control_where"])
    control = seed_outcomes(records, kind=claim["kind"], arm=claim["arm"], field=claim["field"],
                            where=control_where, objective="sft")
    keys = sorted(set(arm) & set(baseline))
    a, b = [arm[k] for k in keys], [baseline[k] for k in keys]
    differences = seed_differences(a, b)  # what the interval is about, so that the test is too
    steps = sorted({r["steps"] for r in _where(records, claim["kind"], arm=claim["arm"], **where)
                    if (r["build"], r["seed"]) in set(keys) and r.get("steps") is not None})
    shared = sorted(set(arm) & set(control))
    share = bootstrap_difference([arm[k] for k in shared], [control[k] for k in shared],
                                 relative=claim["relative"]) if shared else None
    return ClaimFigures(*bootstrap_contrast(a, b, relative=claim["relative"]), share, differences, steps,
                        paired_t_test(differences),
                        sign_flip_p(differences) if len(differences) <= MAX_SIGN_FLIP_SEEDS else math.nan)


def _number(x: float, *, signed: bool, relative: bool) -> str:
    """``+0.61``, ``−0.84``, ``−50%``: two decimals (whole percents) and a minus sign; ``−0.00`` is a negative
    number too small to show, so an interval that reaches below 0 never reads as starting at ``+0.00``."""
    x, digits = (100 * x, 0) if relative else (x, 2)
    x = 0.0 if x == 0 else x  # (-0.0 is 0)
    text = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return text.replace("-", "−") + ("%" if relative else "")


def _interval(iv: Interval, *, signed: bool = True, relative: bool = False) -> str:
    """``+0.61 [+0.59, +0.63]``; ``(no interval)`` where there is none."""
    if math.isnan(iv.mean):
        return "–"
    mean = _number(iv.mean, signed=signed, relative=relative)
    if math.isnan(iv.low):
        return f"{mean} (no interval)"
    return f"{mean} [{_number(iv.low, signed=signed, relative=relative)}, " \
           f"{_number(iv.high, signed=signed, relative=relative)}]"


def _sample(iv: Interval) -> str:
    """``5 seeds × 60 tasks``, or ``3 seeds, seeds only``."""
    seeds = f"{iv.n_seeds} seed{'s' * (iv.n_seeds != 1)}"
    return f"{seeds}, seeds only" if iv.seeds_only else f"{seeds} × {iv.n_tasks} tasks"


def _p(p: float) -> str:
    """``p = 0.056``, ``p < 0.001``."""
    return "p = –" if math.isnan(p) else ("p < 0.001" if p < 0.001 else f"p = {p:.3f}")


def _tests(figures: ClaimFigures) -> str:
    """The paired t-test's p (the test used), the sign-flip test's beside it."""
    t, df, p = figures.t_test
    if math.isnan(t):
        return "– (fewer than 2 seeds)"
    if max(figures.differences) - min(figures.differences) <= 1e-12:
        t_cell = "no spread: every seed the same difference"
    else:
        t_cell = f"t = {_number(t, signed=True, relative=False)}, df {df}, {_p(p)}"
    return f"{t_cell}; sign-flip {_p(figures.sign_flip_p)}"


def _setting(claim: dict) -> str:
    """``fact_hunt 135M, budget 384, d300``: the filters a claim's arm is read with."""
    where = claim["where"]
    parts = [" ".join(str(where[k]) for k in ("task", "size") if k in where)]
    parts += [f"budget {where['budget'] or 'none'}"] if "budget" in where else []
    parts += [str(where["variant"])] if where.get("variant") else []
    return ", ".join(p for p in parts if p)


def _contrast(claim: dict) -> str:
    """``summarize − window``, ``heldout_after − heldout_before``, or both where arm and field differ."""
    arms = claim["arm"] if claim["baseline"] == claim["arm"] else f"{claim['arm']} − {claim['baseline']}"
    fields = claim["field"] if claim["baseline_field"] == claim["field"] else \
        f"{claim['field']} − {claim['baseline_field']}"
    return f"`{arms}`, `{fields}`" + (" (relative to the baseline)" if claim["relative"] else "")


def claim_row(claim: dict, figures: ClaimFigures, links: list[str]) -> str:
    """One row of the claims table."""
    relative = claim["relative"]
    level = _interval(figures.arm, signed=False) + " vs " + _interval(figures.baseline, signed=False)
    steps = f"; {_span(figures.steps)} RL steps" if figures.steps else ""
    figure = "not run" if not figures.figure.n_seeds else \
        f"**{_interval(figures.figure, relative=relative)}** ({level}); {_sample(figures.figure)}{steps}"
    share = "no SFT-only control run" if figures.share is None else \
        f"{_interval(figures.share, relative=relative)}; {_sample(figures.share)}"
    verdict_label, basis = verdict(figures.figure, figures.share, direction=claim["direction"], goal=claim["goal"])
    cap = claim["at_most"]
    if cap and VERDICT_ORDER.index(verdict_label) > VERDICT_ORDER.index(cap):
        verdict_label, basis = cap, f"{basis}; held to {cap} by what the records show beyond the figure (below)"
    goal = "" if not claim["goal"] else \
        f"; goal: {'within ±' if claim['direction'] == 'within' else ''}" \
        f"{_number(claim['goal'], signed=False, relative=relative)}"
    name, paper, why = (claim[k].replace("|", "\\|") for k in ("name", "paper", "why"))  # a | would end the cell
    return (f"| {name} ({_setting(claim)}: {_contrast(claim)}{goal}; {', '.join(links)}) | {paper} "
            f"| {figure} | {share} | {_tests(figures)} "
            f"| **{verdict_label}** ({basis}). {why} |")


def claims_page(claims_path: Path) -> str:
    """The page ``claims_path`` describes (its ``page``): how it is made, then one row per claim, then the
    records that could not be read. Records files are named relative to ``records_dir``; links are relative to
    the page, so they stay inside the repository."""
    spec = tomllib.loads(claims_path.read_text())
    claims = [claim_settings(entry, i) for i, entry in enumerate(spec.get("claim", []))]
    page = (claims_path.parent / spec["page"]).resolve()
    records_dir = (claims_path.parent / spec["records_dir"]).resolve()
    loaded: dict[str, list[dict]] = {}
    skipped: list[str] = []
    rows = []
    for claim in claims:
        for name in claim["records"]:
            if name not in loaded:
                loaded[name] = load_records(records_dir / name, skipped)
        records = [r for name in claim["records"] for r in loaded[name]]
        links = [f"[{name}]({os.path.relpath(records_dir / name, page.parent)})" for name in claim["records"]]
        rows.append((claim, claim_figures(claim, records), links))
    seeds = sorted({figures.figure.n_seeds for _, figures, _ in rows if figures.figure.n_seeds})
    controlled = sum(figures.share is not None for _, figures, _ in rows)
    lines = [*_page_header(claims_path, page, seeds, controlled, len(rows)), "",
             "| claim (setting: contrast; records) | paper's figure | ctxrl's figure: mean [95% interval] (arm vs "
             "baseline); n | RL's share: after RL − SFT-only control | paired test | verdict |",
             "|---|---|---|---|---|---|",
             *(claim_row(claim, figures, links) for claim, figures, links in rows)]
    if skipped:
        lines += ["", "Records named above that could not be read:", "", *(f"- {line}" for line in skipped)]
    return "\n".join(lines) + "\n"


def _span(values: list[int]) -> str:
    """``1 to 9``, ``3``, or ``no``."""
    if not values:
        return "no"
    return str(values[0]) if values[0] == values[-1] else f"{values[0]} to {values[-1]}"


def _page_header(claims_path: Path, page: Path, seeds: list[int], controlled: int, claims: int) -> list[str]:
    """How the page is made and how to read it; every number in it comes from ``experiments/stats.py``."""
    claims_link = os.path.relpath(claims_path.resolve(), page.parent)
    repository = Path(__file__).resolve().parents[1]
    command = f"python experiments/tables.py claims {os.path.relpath(claims_path.resolve(), repository)} --write"
    floors = ", ".join(f"{sign_flip_floor(n):.4g} with {n}" for n in sorted({*seeds, RESULT_SEEDS}))
    return [
        "# The seed papers' claims against ctxrl's records",
        "",
        f"Generated by `{command}` from the records that [claims.toml]({claims_link}) names; edit that file, "
        "not this page (`tests/test_tables.py` fails when the two differ). Each row compares one arm with a "
        "baseline, run with the same seeds.",
        "",
        f"- **ctxrl's figure**: arm − baseline, paired by build and seed (a seed below is one such pair): the mean "
        f"over seeds, its "
        f"{CONFIDENCE:.0%} percentile-bootstrap interval ({RESAMPLES} resamples of the seeds, then of each drawn "
        "seed's held-out tasks, paired by task id) and n seeds × n tasks. Records without per-task outcomes, which "
        "is every record committed before issue 49, resample seeds only (*seeds only*): their intervals leave out "
        "the error of the held-out tasks drawn, and are too narrow.",
        f"- **Seeds**: the claims below rest on {_span(seeds)} seeds each. Fewer than {RESULT_SEEDS} seeds is a "
        f"pilot; {RESULT_SEEDS} is a result.",
        "- **RL's share**: the arm's figure after RL minus the same arm after the SFT-only control (the same warm "
        "start, then as many SFT optimizer steps as RL takes: `train.objective = \"sft\"`), paired by seed. "
        f"{controlled} of the {claims} claims below have such a control run.",
        "- **Paired test**: the paired t-test over seed-level differences (two-sided) is the test used. The exact "
        "sign-flip test is beside it; it cannot go below 2 / 2^n with n seeds "
        f"({floors} seeds).",
        "- **Verdict** (`verdict` in `experiments/stats.py`): *not reproduced* when the interval does not exclude 0 "
        "on the paper's side; a claim of no effect (*within*) is *reproduced* when the whole interval lies within "
        "its goal; otherwise *no control* when no SFT-only control ran (an effect, but nothing says RL made it "
        "rather than the warm start), *reproduced* when RL's share also excludes 0 on the paper's side and the "
        "size goal is met, *direction only* when the direction holds but not the size or RL's share. Then the "
        "claim's own 'why'.",
    ]


