"""Tables and plots from ``experiments/batch.py`` runs: means with standard errors over builds and seeds, and the
claims table of the seed papers with bootstrap intervals and paired tests (``experiments/stats.py``).

Run names follow the plans' pattern ``TASK SIZE-bBUILD-sSEED[-ARM[BUDGET]][-VARIANT]``
(``fh26-b1-s0-window320``: fact_hunt, the 26M model, build 1, RL seed 0, the window manager at 320
tokens; ``fh26-b1-s0-select352-lr2e-5`` is the same arm with another setting, grouped and compared
apart from the plain arm). ``collect`` reads a batch directory's runs into one JSON file of plain
records, small enough to keep in the docs; it names every run it skips and why:

- ``experiments/context.py`` runs: held-out before and after RL, OOD after, peak context,
  summaries and selections per episode, success by evaluation-time summary limit;
- ``experiments/meta.py reflection`` runs: one record per arm (attempt-1 success, success at and
  by attempt K, the sampled pass@K);
- ``benchmarks/env_training.py`` runs (read from ``metrics.jsonl``, so a run stopped after its last
  evaluation counts): the warm start's last SFT loss, held-out before and after, tool calls per
  episode over the last 10 RL steps, void-turn rate, the largest gradient norm, and every held-out
  evaluation (step, success, calls), so that an arm is compared with GRPO at a step both reached.

Since issue 49 every record also carries its training ``objective`` ("rl", or "sft" for the SFT-only control)
and, from the first and last held-out evaluations, the outcome per task (``heldout_tasks_before``/``_after``; for
trials success by attempt per task) and what summaries kept (``summary_retention_*``); older records read these
as None. ``load_records`` reads any committed records file: ``collect``'s, the hand-made lists of issues 36 and
37, ``experiments/selfplay.py``'s summaries; a file or entry it cannot interpret is named, with the reason.

A build is named by the machine that made it too (``--machine``): GPU pre-training is not
reproducible across machines, so ``b0`` on two machines is two builds. A run named in several batches
of one ``collect`` (run again after a failure) is taken from the last of them.

``report --plots DIR`` draws, per task and model size, held-out success per manager and budget
(``context-*.png``), success by the evaluation-time limit (``limits-*.png``) and, for
``env_training.py`` runs, held-out success and tool calls by RL step per arm (``training-*.png``); per task
the model ladder (``ladder-*.png``).

    python experiments/tables.py collect runs/batch --machine h100x4 --out results.json
    python experiments/tables.py report results.json --plots docs/experiments    # markdown on stdout
    python experiments/tables.py claims experiments/claims.toml --write          # docs/experiments/README.md

``claims`` compares each claim of ``experiments/claims.toml`` (an arm against a baseline, paired by build and
seed) and writes the page: ctxrl's figure with its 95% interval over seeds and held-out tasks, RL's share (after
RL minus the SFT-only control), the paired tests and the verdict (the rules are ``stats.verdict``'s).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import tomllib

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling scripts (claims.py, context_rl.py, stats.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

NAME = re.compile(r"^(?P<task>[a-z]+)(?P<size>\d+)-b(?P<build>\d+)-s(?P<seed>\d+)"
                  r"(?:-(?P<arm>[a-z]+?)(?P<budget>\d+)?)?(?:-(?P<variant>[A-Za-z][A-Za-z0-9.+_]*(?:-[A-Za-z0-9.+_]+)*))?$")
TASKS = {"fh": "fact_hunt", "sj": "search_join", "cb": "codebreak", "pm": "python_math", "sq": "search_qa",
         "hw": "hidden_word", "ca": "calculator", "cs": "reasoning_gym:chain_sum", "csnt": "reasoning_gym:chain_sum",
         "pr": "reasoning_gym:products", "lc": "reasoning_gym:leg_counting", "kuhn": "kuhn_poker",
         "ps": "propose_solve", "repo": "repo_tasks"}
# 135: SmolLM2-135M-Instruct; 270: Gemma 3 270M (base): the real models
SIZES = {"1": "1M", "5": "5.2M", "26": "26M", "135": "135M", "270": "270M"}
TASK_VARIANTS = {"csnt": "notool"}  # task codes that name a setting of their task, not another task
KINDS = ("context", "meta", "training", "selfplay")  # what a record is: which script's run it reads


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample standard deviation / sqrt(n)); the error is NaN for one value."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _config(run_dir: Path, manager: str) -> dict:
    """The manager's run config (``MANAGER/config.toml``; empty if there is none)."""
    path = run_dir / manager / "config.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def _exists(path: Path) -> bool:
    """Whether a ``metrics.jsonl`` is there, or its ``.gz`` (``_rows`` reads either)."""
    return path.is_file() or path.with_name(path.name + ".gz").is_file()


def _rows(path: Path) -> list[dict]:
    """The JSON lines of a ``metrics.jsonl`` (or of the ``metrics.jsonl.gz`` beside it, as committed records keep
    them)."""
    if not path.is_file() and path.with_name(path.name + ".gz").is_file():
        path = path.with_name(path.name + ".gz")
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def first_step(metrics: Path) -> dict[str, float | None]:
    """What RL met right after the warm start: the first RL step's policy entropy and how many of its groups had
    no reward variance (groups that teach nothing); None where the run has no RL row."""
    rl = [r for r in _rows(metrics) if r.get("phase") == "rl"] if _exists(metrics) else []
    first = rl[0] if rl else {}
    return {"entropy_first": first.get("entropy"), "zero_variance_first": first.get("zero_variance_groups")}


# A record's per-evaluation fields and the eval-row keys they are read from, the first a row has. The retention
# figures were named twice while issue 49's runs were written: summary_fact_retention / summaries_scored /
# task_summary_retention, and ctxrl's fact_survival / fact_survival_rewrites / task_fact_survival.
EVAL_ROW_KEYS = {"heldout_tasks": ("task_success",),
                 "summary_retention": ("summary_fact_retention", "fact_survival"),
                 "summaries_scored": ("summaries_scored", "fact_survival_rewrites"),
                 "summary_retention_tasks": ("task_summary_retention", "task_fact_survival")}


def heldout_outcomes(rows: list[dict]) -> dict:
    """Per-task held-out outcomes and what summaries kept, from a run's metrics rows (issue 49's fields of an
    ``eval`` row; None where a row lacks them): the first held-out evaluation is "before" (the warm start's) and
    the last "after". A run that evaluated once (a meta-RL arm, a warm start) has an "after" and no "before".

    - ``heldout_tasks_before``/``_after``: task id -> success (mean over that task's episodes);
    - ``heldout_tasks_by_attempt_after``: task id -> success by attempt k = 1..K (trial evaluations);
    - ``summary_retention_*``: the fraction of the facts the answer needs that survive each summary;
      ``summaries_scored_*``: how many summaries that is over; ``summary_retention_tasks_*``: per task."""
    heldout = [r for r in rows if r.get("phase") == "eval" and r.get("split") == "heldout"]
    last = heldout[-1] if heldout else {}
    first = heldout[0] if len(heldout) > 1 else {}
    return {"heldout_tasks_by_attempt_after": last.get("task_success_by_attempt"),
            **{f"{field}_{when}": next((row[k] for k in keys if k in row), None)
               for field, keys in EVAL_ROW_KEYS.items() for when, row in (("before", first), ("after", last))}}


def run_outcomes(directory: Path) -> dict:
    """What one run directory (a ``config.toml`` beside a ``metrics.jsonl``) adds to its record: its training
    ``objective`` (``train.objective``: "rl" unless it is the SFT-only control, "sft") and ``heldout_outcomes``."""
    config = directory / "config.toml"
    table = tomllib.loads(config.read_text()) if config.is_file() else {}
    metrics = directory / "metrics.jsonl"
    return {"objective": table.get("train", {}).get("objective", "rl"), "eval_seed": table.get("eval", {}).get("seed"),
            **heldout_outcomes(_rows(metrics) if _exists(metrics) else [])}


def _by_attempt(field: str, pick: Callable[[list[float]], float]) -> Callable[[dict], dict[str, float] | None]:
    """Per-task outcomes read from a record's success-by-attempt lists: ``pick(list)`` per task."""
    def read(record: dict) -> dict[str, float] | None:
        lists = record.get(field)
        return {task: pick(by_attempt) for task, by_attempt in lists.items()} if lists else None
    return read


# The per-task outcomes behind a record's figure, for the bootstrap over tasks (``task_outcomes``). A figure not
# named here (a training-time figure, or one the runs record no per-task outcomes for) is resampled over seeds only.
TASK_OUTCOMES = {
    "heldout_before": lambda r: r.get("heldout_tasks_before"),
    "heldout_after": lambda r: r.get("heldout_tasks_after"),
    "summary_retention_before": lambda r: r.get("summary_retention_tasks_before"),
    "summary_retention_after": lambda r: r.get("summary_retention_tasks_after"),
    "attempt1": _by_attempt("heldout_tasks_by_attempt_after", lambda s: s[0]),
    "success_by_k": _by_attempt("heldout_tasks_by_attempt_after", lambda s: s[-1]),
    "gain": _by_attempt("heldout_tasks_by_attempt_after", lambda s: s[-1] - s[0]),
    "success_by_k_sampled": _by_attempt("sampled_tasks_by_attempt", lambda s: s[-1]),
}


def task_outcomes(record: dict, field: str) -> dict[str, float] | None:
    """Task id -> the outcome whose mean is the record's ``field``; None where the record has none for it."""
    read = TASK_OUTCOMES.get(field)
    return read(record) if read else None


def _context_record(base: dict, manager: str, run_dir: Path, r: dict) -> dict:
    """One context manager's record from its figures ``r`` (the names of ``summary.json``)."""
    budget = _config(run_dir, manager).get("context", {}).get("max_context_tokens") or None  # None: unlimited
    return {**base, "kind": "context", "arm": manager, "budget": budget,
            **first_step(run_dir / manager / "metrics.jsonl"), **run_outcomes(run_dir / manager),
            "heldout_before": r["heldout_before"], "heldout_after": r["heldout_after"], "ood_after": r["ood_after"],
            **{k: r.get(k) for k in ("peak_context", "summaries_per_episode", "selections_per_episode",
                                     "heldout_by_eval_summaries", "ood_by_eval_summaries")}}


def _context_records(base: dict, summary: dict, run_dir: Path) -> list[dict]:
    return [_context_record(base, manager, run_dir, r) for manager, r in summary.items()]


def _context_from_metrics(base: dict, manager: str, run_dir: Path) -> dict | None:
    """A context run that wrote no summary (its evaluation-time sweep failed or was cut off) but finished
    RL and the evaluation after it: the record from its ``metrics.jsonl``, with the sweep's finished limits."""
    steps = _config(run_dir, manager).get("train", {}).get("steps")
    rows = _rows(run_dir / manager / "metrics.jsonl")
    evals = {split: [r for r in rows if r.get("phase") == "eval" and r.get("split") == split]
             for split in ("heldout", "ood")}
    if len(evals["heldout"]) < 2 or not evals["ood"] or \
            not evals["heldout"][-1]["step"] == evals["ood"][-1]["step"] == steps:
        return None
    final = evals["heldout"][-1]
    sweep = _partial_sweep(run_dir, manager)
    return _context_record(base, manager, run_dir, {
        "heldout_before": evals["heldout"][0]["success"], "heldout_after": final["success"],
        "ood_after": evals["ood"][-1]["success"], "peak_context": final.get("context_peak_tokens_max"),
        "summaries_per_episode": final.get("summaries_per_episode"),
        "selections_per_episode": final.get("selections_per_episode"),
        "heldout_by_eval_summaries": {k: v["heldout"] for k, v in sweep.items()} or None,
        "ood_by_eval_summaries": {k: v["ood"] for k, v in sweep.items()} or None})


def _partial_sweep(run_dir: Path, manager: str) -> dict[str, dict[str, float]]:
    """The evaluation-time limits of a cut-short run's sweep (``MANAGER-eval-K`` directories, as
    ``experiments/context.py`` writes them) that finished both splits."""
    sweep = {}
    for path in run_dir.glob(f"{manager}-eval-*/metrics.jsonl"):
        limit = path.parent.name.rsplit("-", 1)[1]
        success = {r["split"]: r["success"] for r in _rows(path) if r.get("phase") == "eval"}
        if limit.isdigit() and {"heldout", "ood"} <= set(success):
            sweep[limit] = {"heldout": success["heldout"], "ood": success["ood"]}
    return dict(sorted(sweep.items(), key=lambda kv: int(kv[0])))


def _meta_records(base: dict, summary: dict, run_dir: Path) -> list[dict]:
    """One record per arm of a reflection run, its figures from ``summary.json`` and its per-task outcomes from
    the arm's directory (``ARM/metrics.jsonl``; the sampled evaluation's from ``ARM-sampled``)."""
    k = summary["attempts"]
    records = []
    for arm, r in summary["arms"].items():
        h, s = r["heldout"], r.get("sampled", {})
        first, by_k = h.get("success"), h.get(f"success_by_{k}")
        sampled = run_outcomes(run_dir / f"{arm}-sampled")["heldout_tasks_by_attempt_after"]
        records.append({**base, "kind": "meta", "arm": arm, "attempts": k, "steps": summary["steps"],
                        **run_outcomes(run_dir / arm), "sampled_tasks_by_attempt": sampled,
                        "attempt1": first, "success_by_k": by_k,
                        "gain": None if first is None or by_k is None else by_k - first,
                        "success_at_k": h.get(f"success_at_{k}"), "tool_errors_at_1": h.get("tool_errors_at_1"),
                        "pass_at_k_sampled": s.get(f"pass_at_{k}"), "success_by_k_sampled": s.get(f"success_by_{k}")})
    return records


def _training_record(base: dict, metrics: Path) -> dict | None:
    """An ``env_training.py`` run's record from its ``metrics.jsonl``: None unless it took steps and evaluated
    after them. The SFT-only control's steps (``sft_control`` rows) count as its steps; it has no rollouts, so
    the figures of RL's own rows (tool calls, void turns, gradient norms while training) are None for it."""
    rows = _rows(metrics)
    rl = [r for r in rows if r.get("phase") == "rl"]
    steps = rl or [r for r in rows if r.get("phase") == "sft_control"]
    heldout = [r for r in rows if r.get("phase") == "eval" and r.get("split") == "heldout"]
    if not steps or len(heldout) < 2:
        return None
    last = rl[-10:]
    sft = next((r for r in rows if r.get("phase") == "sft"), {})
    config = metrics.parent / "config.toml"
    context = tomllib.loads(config.read_text()).get("context", {}) if config.is_file() else {}
    final = heldout[-1]
    return {**base, "kind": "training", "steps": len(steps), "sft_loss_last": sft.get("sft_loss_last"),
            "budget": context.get("max_context_tokens") or None,
            "peak_context_after": final.get("context_peak_tokens_max"),
            "summaries_per_episode_after": final.get("summaries_per_episode"),
            **first_step(metrics), **run_outcomes(metrics.parent),
            "heldout_before": heldout[0]["success"], "heldout_after": heldout[-1]["success"],
            "heldout_calls_after": heldout[-1].get("tool_calls"),
            "train_calls_last10": sum(r["tool_calls"] for r in last) / len(last) if last else None,
            "void_turn_rate_last10": sum(r.get("void_turn_rate", 0.0) for r in last) / len(last) if last else None,
            "grad_norm_max": max(r.get("grad_norm", 0.0) for r in rl) if rl else None,
            "heldout_curve": [[r["step"], r["success"], r.get("tool_calls")] for r in heldout]}


def collect(batch: Path, machine: str, skipped: list[str] | None = None) -> list[dict]:
    """Records of every finished run under ``batch/runs`` (see the module docstring). A run that is not
    read (an odd name, no results, a file that does not parse) is added to ``skipped`` with the reason."""
    records = []
    for run_dir in sorted(p for p in (batch / "runs").iterdir() if p.is_dir()):
        try:
            records += _read_run(run_dir, machine)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON and TOML errors are ValueErrors
            if skipped is not None:
                skipped.append(f"{run_dir.name}: {exc}" if isinstance(exc, _Skip) else
                               f"{run_dir.name}: could not be read ({type(exc).__name__}: {exc})")
    return records


def collect_batches(batches: list[Path], machine: str, skipped: list[str]) -> list[dict]:
    """``collect`` over several batches; a run named in more than one (run again after a failure) is taken from
    the last, and the one it replaces is added to ``skipped``."""
    records: list[dict] = []
    for batch in batches:
        new = collect(batch, machine, skipped)
        again = {r["name"] for r in new} & {r["name"] for r in records}
        skipped += [f"{name} of an earlier batch: {batch} ran it again" for name in sorted(again)]
        records = [r for r in records if r["name"] not in again] + new
    return records


class _Skip(ValueError):
    """Why a run directory gives no records."""


def _base(name: str, machine: str, g: dict) -> dict:
    """The fields every record of a run has, from the groups of its name (``NAME``). A task code that stands for
    a setting of its task (``csnt``: chain_sum without a tool) adds that setting to the variant, so the two runs
    are not paired as one arm."""
    variant = "-".join(v for v in (TASK_VARIANTS.get(g["task"]), g["variant"]) if v) or None
    return {"name": name, "machine": machine, "task": TASKS.get(g["task"], g["task"]),
            "size": SIZES.get(g["size"], g["size"]), "build": f"{machine}/b{g['build']}", "seed": int(g["seed"]),
            "variant": variant}


def _read_run(run_dir: Path, machine: str) -> list[dict]:
    match = NAME.match(run_dir.name)
    if not match or (match["variant"] and not match["arm"]):
        raise _Skip("not a TASK SIZE-bBUILD-sSEED[-ARM[BUDGET]][-VARIANT] name")
    g = match.groupdict()
    base = _base(run_dir.name, machine, g)
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if summary.get("experiment") == "reflection":
            return _meta_records(base, summary, run_dir)
        if summary and all(isinstance(v, dict) and "heldout_after" in v for v in summary.values()):
            return _context_records(base, summary, run_dir)
    if g["arm"] and _exists(run_dir / g["arm"] / "metrics.jsonl"):  # a context run cut short
        record = _context_from_metrics(base, g["arm"], run_dir)
        if not record:
            raise _Skip("stopped before its evaluation after RL")
        return [record]
    metrics = sorted({p.with_suffix("") if p.suffix == ".gz" else p
                      for p in [*run_dir.glob("*/metrics.jsonl"), *run_dir.glob("*/metrics.jsonl.gz")]})
    record = _training_record({**base, "arm": g["arm"]}, metrics[0]) if metrics and g["arm"] else None
    if not record:
        raise _Skip("no results (no summary.json, or metrics.jsonl without an evaluation after RL): it failed "
                    "or was stopped")
    return [record]


RECORD_FILE_SUFFIXES = (".json", ".jsonl")
# What records carry since issue 49 (held-out outcomes per task, summary retention, the training objective);
# a record written before has none of them, and reads them as None.
OUTCOME_FIELDS = ("objective", "eval_seed", "heldout_tasks_before", "heldout_tasks_after",
                  "heldout_tasks_by_attempt_after", "sampled_tasks_by_attempt", "summary_retention_before",
                  "summary_retention_after", "summaries_scored_before", "summaries_scored_after",
                  "summary_retention_tasks_before", "summary_retention_tasks_after")


def normalise(record: dict) -> dict:
    """A record with every field of today's records: the ones an older record lacks are None."""
    return {"variant": None, **dict.fromkeys(OUTCOME_FIELDS), **record}


def load_records(path: Path, skipped: list[str]) -> list[dict]:
    """Every record one committed file holds, whatever wrote it: ``collect``'s records, or the hand-made lists of
    issues 36 and 37 and ``experiments/selfplay.py``'s summaries. A file, or an entry of one, that this cannot
    interpret is added to ``skipped`` as ``PATH: why`` (never dropped silently)."""
    try:
        text = path.read_text()
        data = [json.loads(x) for x in text.splitlines() if x.strip()] if path.suffix == ".jsonl" else json.loads(text)
    except (OSError, ValueError) as exc:
        skipped.append(f"{path}: could not be read ({type(exc).__name__}: {exc})")
        return []
    for reader in (_collected_records, _hand_made_records, _selfplay_summary_records):
        records = reader(data, path, skipped)
        if records is not None:
            return [normalise(r) for r in records]
    skipped.append(f"{path}: {_unread_shape(data)}")
    return []


def _dicts_with(data, key: str) -> bool:
    return isinstance(data, list) and bool(data) and all(isinstance(x, dict) and key in x for x in data)


def _collected_records(data, path: Path, skipped: list[str]) -> list[dict] | None:
    """``collect``'s own output: a list of records, each with its ``kind``."""
    return data if _dicts_with(data, "kind") else None


HAND_NAME = re.compile(r"^(?P<task>[a-z]+)(?P<size>\d+)-s(?P<seed>\d+)-(?P<arm>[a-z]+)$")


def _hand_made_records(data, path: Path, skipped: list[str]) -> list[dict] | None:
    """A list of runs written by hand from a batch's output, one entry per run with its ``run`` name (issue 36:
    success before and after per split; issue 37: ``selfplay.py``'s evaluation rows before and after). A name
    without a build (``cs135-s0-warm``) is the plan's ``b0``: a named real model has one build. The machine is
    the file's directory (``issue36``)."""
    if not _dicts_with(data, "run"):
        return None
    records = []
    for entry in data:
        match = NAME.match(entry["run"]) or HAND_NAME.match(entry["run"])
        if not match or not match["arm"]:
            skipped.append(f"{path}: {entry['run']}: not a TASK SIZE-[bBUILD-]sSEED-ARM name")
            continue
        base = {**_base(entry["run"], path.parent.name, {"build": "0", "variant": None, **match.groupdict()}),
                "arm": match["arm"]}
        if isinstance(entry.get("before"), dict) and isinstance(entry.get("after"), dict):
            records.append(_selfplay_record(base, entry["before"], entry["after"], entry.get("steps")))
        elif "heldout_before" in entry and "heldout_after" in entry:
            records.append({**base, "kind": "training", "steps": entry.get("steps"),
                            "heldout_before": entry["heldout_before"], "heldout_after": entry["heldout_after"],
                            "ood_after": entry.get("ood_after")})
        else:
            skipped.append(f"{path}: {entry['run']}: neither held-out success before and after nor evaluation rows")
    return records


def _selfplay_summary_records(data, path: Path, skipped: list[str]) -> list[dict] | None:
    """``experiments/selfplay.py``'s ``selfplay.json``: evaluation rows before and after per ``ENV-sSEED``. It
    names no model, so the records' size is None."""
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or not runs or \
            not all(isinstance(r, dict) and {"before", "after"} <= set(r) for r in runs.values()):
        return None
    records = []
    for key, run in runs.items():
        task, _, seed = key.rpartition("-s")
        if not seed.isdigit():
            skipped.append(f"{path}: {key}: not an ENV-sSEED key")
            continue
        base = {"name": f"{path.stem}:{key}", "machine": path.parent.name, "task": task, "size": None,
                "build": f"{path.parent.name}/b0", "seed": int(seed), "variant": None, "arm": "selfplay"}
        records.append(_selfplay_record(base, run["before"], run["after"], run.get("steps")))
    return records


def _selfplay_record(base: dict, before: dict, after: dict, steps: int | None) -> dict:
    """A self-play run's held-out success before and after RL, and its win rate and chips a hand against each
    scripted opponent (``win_rate_vs_random_before`` ...)."""
    opponents = sorted(k.removeprefix("win_rate_vs_") for k in before if k.startswith("win_rate_vs_"))
    return {**base, "kind": "selfplay", "steps": steps, "heldout_before": before.get("success"),
            "heldout_after": after.get("success"),
            **{f"{figure}_vs_{o}_{when}": row.get(f"{figure}_vs_{o}") for o in opponents
               for figure in ("win_rate", "reward") for when, row in (("before", before), ("after", after))}}


def _unread_shape(data) -> str:
    """Why a file's contents are not records, in words."""
    if isinstance(data, dict) and "experiment" in data:
        return (f"a meta.py summary ({data['experiment']!r}): it names no run, seed or model size to file its "
                "figures under")
    if _dicts_with(data, "phase"):
        return "a run's metrics rows on their own: no run name to file them under"
    keys = ", ".join(list(data)[:6]) if isinstance(data, dict) else f"{len(data)} entries"
    return f"not a records file this reads (a JSON {type(data).__name__}: {keys})"


def _fmt(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def _signed(mean: float, se: float) -> str:
    """A difference with its sign and standard error (none for one pair; a dash for no pairs)."""
    if math.isnan(mean):
        return "–"
    return f"{mean:+.2f}" + ("" if math.isnan(se) else f" ± {se:.2f}")


def _cell(values: list[float]) -> str:
    m, se = mean_se(values)
    return f"{_fmt(m)} ± {_fmt(se)}" if len(values) > 1 else _fmt(m)


def _groups(records: list[dict], kind: str, keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r["kind"] == kind:
            groups[tuple(r.get(k) for k in keys)].append(r)
    return groups


def _values(group: list[dict], field: str) -> list[float]:
    """``field`` of every record in ``group`` that has it."""
    return [r[field] for r in group if r.get(field) is not None]


def _arm(arm: str, variant: str | None) -> str:
    """An arm's label: ``select``, or ``select lr2e-5`` for a variant."""
    return f"{arm} {variant}" if variant else arm


def _runs(group: list[dict], field: str) -> str:
    """Per-run values, labelled machine/build and seed: ``h100x4/b1 s0: 0.97``."""
    return ", ".join(f"{r['build']} s{r['seed']}: {_fmt(r[field])}" for r in group)


def _arms(records: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """Context records grouped by (task, size, arm, variant, budget), in a stable order."""
    groups = _groups(records, "context", ("task", "size", "arm", "variant", "budget"))
    return sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0]))


def context_table(records: list[dict]) -> str:
    lines = ["| task | model | manager | budget | runs | held-out before RL | held-out after RL | OOD after | "
             "summaries / ep | selections / ep | held-out after, per run |", "|---" * 11 + "|"]
    for (task, size, arm, variant, budget), group in _arms(records):
        cells = " | ".join(_cell(_values(group, f)) for f in ("heldout_before", "heldout_after", "ood_after",
                                                                "summaries_per_episode", "selections_per_episode"))
        lines.append(f"| {task} | {size} | {_arm(arm, variant)} | {budget or '–'} | {len(group)} | {cells} | "
                     f"{_runs(group, 'heldout_after')} |")
    return "\n".join(lines) + "\n"


def _seed_dof(values_by_build: dict[str, list[float]]) -> int:
    """Degrees of freedom of the pooled between-seed SD: seeds beyond the first, summed over builds."""
    return sum(len(v) - 1 for v in values_by_build.values())


def spread(values_by_build: dict[str, list[float]]) -> tuple[float, float]:
    """Two sources of variance: the pooled standard deviation between RL seeds of one build, and the
    standard deviation of the build means (NaN where there are too few seeds or builds)."""
    dof = _seed_dof(values_by_build)
    within = sum((x - sum(v) / len(v)) ** 2 for v in values_by_build.values() for x in v)
    means = [sum(v) / len(v) for v in values_by_build.values()]
    between = statistics.stdev(means) if len(means) > 1 else math.nan
    return (math.sqrt(within / dof) if dof else math.nan), between


def variance_table(records: list[dict]) -> str:
    """Held-out after RL: spread between seeds of one build against spread between builds, per arm with
    more than one build. A build mean over few seeds carries their noise, so the second figure
    overstates the builds' own spread somewhat; a pooled seed SD on 1-2 degrees of freedom is rough."""
    lines = ["| task | model | manager | budget | builds | runs | SD between seeds (pooled within builds) | "
             "its degrees of freedom | SD between build means |", "|---|---|---|---|---|---|---|---|---|"]
    for (task, size, arm, variant, budget), group in _arms(records):
        by_build: dict[str, list[float]] = defaultdict(list)
        for r in group:
            by_build[r["build"]].append(r["heldout_after"])
        if len(by_build) < 2:
            continue
        within, between = spread(by_build)
        lines.append(f"| {task} | {size} | {_arm(arm, variant)} | {budget or '–'} | {len(by_build)} | {len(group)} | "
                     f"{_fmt(within)} | {_seed_dof(by_build)} | {_fmt(between)} |")
    return "\n".join(lines) + "\n"


def sweep_table(records: list[dict]) -> str:
    lines = ["| task | model | manager | budget | run | held-out by summaries (selections) allowed at evaluation "
             "| OOD by summaries (selections) allowed |", "|---|---|---|---|---|---|---|"]
    swept = [r for r in records if r["kind"] == "context" and r.get("heldout_by_eval_summaries")]
    for r in sorted(swept, key=lambda r: (r["task"], r["size"], r["arm"], r.get("variant") or "", r["budget"] or 0,
                                          r["build"], r["seed"])):
        heldout = ", ".join(f"{k}: {_fmt(v)}" for k, v in r["heldout_by_eval_summaries"].items())
        ood = ", ".join(f"{k}: {_fmt(v)}" for k, v in r["ood_by_eval_summaries"].items())
        lines.append(f"| {r['task']} | {r['size']} | {_arm(r['arm'], r.get('variant'))} | {r['budget']} | "
                     f"{r['build']} s{r['seed']} | "
                     f"{heldout} | {ood} |")
    return "\n".join(lines) + "\n"


def meta_table(records: list[dict]) -> str:
    lines = ["| task | model | arm | runs | attempt-1 success | success by attempt K | gain (by K − at 1) | "
             "pass@K sampled | success by K sampled |", "|---|---|---|---|---|---|---|---|---|"]
    for (task, size, arm, variant), group in _groups(records, "meta", ("task", "size", "arm", "variant")).items():
        cells = " | ".join(_cell(_values(group, f)) for f in ("attempt1", "success_by_k", "gain", "pass_at_k_sampled",
                                                                "success_by_k_sampled"))
        lines.append(f"| {task} | {size} | {_arm(arm, variant)} | {len(group)} | {cells} |")
    return "\n".join(lines) + "\n"


def training_table(records: list[dict]) -> str:
    lines = ["| task | model | arm | runs | held-out before | held-out after | tool calls / ep, last 10 RL steps | "
             "void-turn rate, last 10 | largest grad norm | held-out after, per run |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (task, size, arm, variant), group in _groups(records, "training", ("task", "size", "arm", "variant")).items():
        cells = " | ".join(_cell(_values(group, f)) for f in ("heldout_before", "heldout_after", "train_calls_last10",
                                                                "void_turn_rate_last10", "grad_norm_max"))
        lines.append(f"| {task} | {size} | {_arm(arm, variant)} | {len(group)} | {cells} | "
                     f"{_runs(group, 'heldout_after')} |")
    return "\n".join(lines) + "\n"


def selfplay_table(records: list[dict]) -> str:
    """Held-out success before and after RL per self-play arm, and the win rate against each scripted opponent."""
    lines = ["| task | model | arm | runs | held-out before | held-out after | win rate before → after, per opponent |",
             "|---|---|---|---|---|---|---|"]
    groups = _groups(records, "selfplay", ("task", "size", "arm", "variant"))
    for (task, size, arm, variant), group in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        opponents = sorted({k[len("win_rate_vs_"):-len("_before")] for r in group for k in r
                            if k.startswith("win_rate_vs_") and k.endswith("_before")})
        rates = "; ".join(f"{o}: {_cell(_values(group, f'win_rate_vs_{o}_before'))} → "
                          f"{_cell(_values(group, f'win_rate_vs_{o}_after'))}" for o in opponents)
        cells = " | ".join(_cell(_values(group, f)) for f in ("heldout_before", "heldout_after"))
        lines.append(f"| {task} | {size or '–'} | {_arm(arm, variant)} | {len(group)} | {cells} | {rates or '–'} |")
    return "\n".join(lines) + "\n"


def _where(records: list[dict], kind: str, **where) -> list[dict]:
    """The records of ``kind`` whose fields equal every value in ``where``."""
    return [r for r in records if r["kind"] == kind and all(r.get(k) == v for k, v in where.items())]


def paired(records: list[dict], kind: str, field: str, arm: str, baseline: str, **where) -> tuple[float, float, int]:
    """Mean and standard error of ``field`` (arm − baseline) over runs matched by build, seed and ``where``
    (plain runs unless ``where`` names a ``variant``)."""
    where.setdefault("variant", None)
    def pick(name):
        return {(r["build"], r["seed"]): r[field] for r in _where(records, kind, arm=name, **where)
                if r.get(field) is not None}

    a, b = pick(arm), pick(baseline)
    diffs = [a[k] - b[k] for k in sorted(set(a) & set(b))]
    m, se = mean_se(diffs)
    return m, se, len(diffs)


def _pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, path: Path) -> Path:
    """Legend, layout, ``path`` written, figure closed."""
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_context(records: list[dict], path: Path, *, task: str, size: str) -> Path | None:
    """Held-out success before and after RL per manager and budget (mean ± SE), for one task and model size."""
    groups = {k: g for k, g in _arms(records) if k[0] == task and k[1] == size}
    if not groups:
        return None
    plt = _pyplot()
    keys = sorted(groups, key=lambda k: (k[4] or 0, k[2], k[3] or ""))  # by budget, then manager and variant
    labels = [f"{_arm(k[2], k[3])}\n{k[4] or 'no budget'}" for k in keys]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(keys)), 3.6))
    for offset, field, label in ((-0.2, "heldout_before", "after warm start"), (0.2, "heldout_after", "after RL")):
        stats = [mean_se([r[field] for r in groups[k]]) for k in keys]
        ax.bar([i + offset for i in range(len(keys))], [m for m, _ in stats], width=0.4,
               yerr=[0.0 if math.isnan(se) else se for _, se in stats], capsize=3, label=label)
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out success")
    ax.set_title(f"{task}, {size} model: mean ± SE over builds and seeds", fontsize=9)
    return _save(fig, ax, path)


def plot_ladder(records: list[dict], path: Path, *, task: str) -> Path | None:
    """Held-out success with the whole history (the ``full`` manager) by model size: one point per build."""
    points = [(r["size"], r["heldout_before"], r["heldout_after"]) for r in records  # plain runs, no variants
              if r["kind"] == "context" and r["task"] == task and r["arm"] == "full" and not r.get("variant")]
    if not points:
        return None
    plt = _pyplot()
    order = sorted({p[0] for p in points}, key=lambda s: float(s.rstrip("M")))
    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    for j, (field, label, marker) in enumerate(((1, "after warm start", "o"), (2, "after RL", "s"))):
        ax.scatter([order.index(p[0]) + (j - 0.5) * 0.12 for p in points], [p[field] for p in points],
                   marker=marker, label=label)
    ax.set_xticks(range(len(order)), order)
    ax.set_xlabel("tiny model size (parameters)")
    ax.set_ylabel("held-out success, whole history")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{task}: the model ladder (one point per build)", fontsize=9)
    return _save(fig, ax, path)


Curve = list[tuple[int, float, float, int]]  # (limit, mean, SE, runs)


def limit_curves(records: list[dict], *, task: str, size: str) -> dict[str, dict[str, Curve]]:
    """Success by the number of summaries (or selections) allowed at evaluation, per manager, budget and variant:
    ``{label: {"heldout"|"ood": [(limit, mean, SE, runs), ...]}}``. Only runs that reached every limit of their
    group count, so each point of a curve averages the same runs (a run whose sweep was cut off would otherwise move
    the curve where it stops)."""
    curves: dict[str, dict[str, Curve]] = {}
    for (t, s, arm, variant, budget), group in _arms(records):
        swept = [r for r in group if r.get("heldout_by_eval_summaries")]
        if t != task or s != size or not swept:
            continue
        limits = set().union(*(r["heldout_by_eval_summaries"].keys() | (r.get("ood_by_eval_summaries") or {}).keys()
                               for r in swept))
        swept = [r for r in swept if all(set(r.get(f"{split}_by_eval_summaries") or {}) == limits
                                         for split in ("heldout", "ood"))]
        if not swept:
            continue
        label = f"{_arm(arm, variant)}, {budget or 'no budget'} ({len(swept)} run{'s' * (len(swept) > 1)})"
        curves[label] = {split: [(int(k), *mean_se([r[f"{split}_by_eval_summaries"][k] for r in swept]), len(swept))
                                 for k in sorted(limits, key=int)] for split in ("heldout", "ood")}
    return curves


def plot_limits(records: list[dict], path: Path, *, task: str, size: str) -> Path | None:
    """Held-out and OOD success by the number of summaries (selections) allowed at evaluation, mean ± SE."""
    curves = limit_curves(records, task=task, size=size)
    if not curves:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, split, title in zip(axes, ("heldout", "ood"), ("held-out", "OOD (longer than training)")):
        for label, by_split in curves.items():
            points = by_split[split]
            ax.errorbar([p[0] for p in points], [p[1] for p in points], marker="o", capsize=3, label=label,
                        yerr=[0.0 if math.isnan(p[2]) else p[2] for p in points])
        ax.set_xlabel("summaries (selections) allowed at evaluation")
        ax.set_title(f"{task}, {size}: {title}", fontsize=9)
        ax.set_ylim(-0.05, 1.05)
    axes[0].set_ylabel("success, mean ± SE over runs")
    return _save(fig, axes[1], path)


def paired_at_step(records: list[dict], arm: str, baseline: str, *, which: str = "last",
                   **where) -> tuple[dict[str, tuple[float, float]], list[int], int]:
    """Held-out success and tool calls per episode, arm − baseline, from the evaluations on training runs' curves
    (``heldout_curve``), each pair at one step both runs evaluated: the last such step (``which="last"``), or the
    first after step 0 (``"first"``). Fair where a run was stopped early: its partner is read at the same step.
    Returns {field: (mean, SE)} for ``success`` and ``calls``, the steps used, and the number of pairs."""
    where.setdefault("variant", None)

    def pick(name):
        return {(r["build"], r["seed"]): {step: (success, calls) for step, success, calls in r["heldout_curve"]}
                for r in _where(records, "training", arm=name, **where) if r.get("heldout_curve")}

    a, b = pick(arm), pick(baseline)
    diffs: dict[str, list[float]] = {"success": [], "calls": []}
    steps = []
    for key in sorted(set(a) & set(b)):
        common = sorted(s for s in set(a[key]) & set(b[key]) if s > 0)
        if not common:
            continue
        step = common[-1] if which == "last" else common[0]
        (sa, ca), (sb, cb) = a[key][step], b[key][step]
        steps.append(step)
        diffs["success"].append(sa - sb)
        if ca is not None and cb is not None:
            diffs["calls"].append(ca - cb)
    return {field: mean_se(values) for field, values in diffs.items()}, steps, len(steps)


def step_table(records: list[dict]) -> str:
    """Each RL arm against grpo on the same build and seed, at a step both evaluated (the first after 0, the last)."""
    lines = ["| comparison | evaluation | steps | pairs | held-out success, difference | held-out tool calls / ep, "
             "difference |", "|---|---|---|---|---|---|"]
    keys = sorted({(r["task"], r["size"], r.get("variant")) for r in records
                   if r["kind"] == "training" and r.get("heldout_curve")}, key=str)
    for task, size, variant in keys:
        where = {"task": task, "size": size, "variant": variant}
        arms = {r["arm"] for r in _where(records, "training", **where)}
        for arm in sorted(arms - {"grpo"}):
            for which in ("first", "last"):
                figures, steps, n = paired_at_step(records, arm, "grpo", which=which, **where)
                if not n:
                    continue
                cells = " | ".join(_signed(*figures[f]) for f in ("success", "calls"))
                label = f"{task} {size}" + (f" ({variant})" if variant else "") + f": {arm} − grpo"
                lines.append(f"| {label} | {which} | {', '.join(map(str, sorted(set(steps))))} | {n} | {cells} |")
    return "\n".join(lines) + "\n"


def contrasts(records: list[dict]) -> str:
    """Paired differences (same build, seed, budget and variant): each manager against window, each RL arm against
    grpo, meta-RL's attempt-K gain against single-episode RL's."""
    lines = ["| comparison | figure | pairs | mean difference ± SE |", "|---|---|---|---|"]

    def add(label, field, kind, arm, baseline, **where):
        m, se, n = paired(records, kind, field, arm, baseline, **where)
        if n:
            spread = f" ± {se:.2f}" if n > 1 else " (one pair: no error estimate)"
            lines.append(f"| {label} | {field} | {n} | {m:+.2f}{spread} |")

    def combos(kind, *keys):
        return sorted({tuple(r.get(k) for k in keys) for r in records if r["kind"] == kind
                       and (kind != "context" or r["budget"])}, key=str)

    def arms(kind, **where):
        return {r["arm"] for r in _where(records, kind, **where)}

    def setting(variant):
        return f" ({variant})" if variant else ""

    for task, size, budget, variant in combos("context", "task", "size", "budget", "variant"):
        where = {"task": task, "size": size, "budget": budget, "variant": variant}
        for arm in sorted(arms("context", **where) - {"window", "full"}):
            for field in ("heldout_before", "heldout_after"):
                add(f"{task} {size}, budget {budget}{setting(variant)}: {arm} − window", field, "context", arm,
                    "window", **where)
    for task, size, variant in combos("training", "task", "size", "variant"):
        where = {"task": task, "size": size, "variant": variant}
        for arm in sorted(arms("training", **where) - {"grpo"}):
            for field in ("heldout_after", "train_calls_last10", "void_turn_rate_last10", "grad_norm_max"):
                add(f"{task} {size}{setting(variant)}: {arm} − grpo", field, "training", arm, "grpo", **where)
    for task, size, variant in combos("meta", "task", "size", "variant"):
        add(f"{task} {size}{setting(variant)}: meta − single", "gain", "meta", "meta", "single",
            task=task, size=size, variant=variant)
    return "\n".join(lines) + "\n"


def training_curves(records: list[dict], *, task: str, size: str) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """Per arm (with its variant) of one task and model size: step -> [(held-out success, held-out calls)] over runs,
    from each run's held-out evaluations (``heldout_curve``: step, success, calls)."""
    curves: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in _where(records, "training", task=task, size=size):
        for step, success, calls in r.get("heldout_curve") or []:
            curves[_arm(r["arm"], r.get("variant"))][step].append((success, calls))
    return curves


def plot_training(records: list[dict], path: Path, *, task: str, size: str) -> Path | None:
    """Held-out success (left) and tool calls per episode (right) by RL step, mean ± SE over runs, one line per arm,
    for one task and model size."""
    curves = training_curves(records, task=task, size=size)
    if not curves:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm in sorted(curves):
        steps = sorted(curves[arm])
        for ax, index in ((left, 0), (right, 1)):
            stats = [mean_se([pair[index] for pair in curves[arm][s]]) for s in steps]
            ax.errorbar(steps, [m for m, _ in stats], yerr=[0.0 if math.isnan(se) else se for _, se in stats],
                        marker="o", capsize=3, label=f"{arm} ({len(curves[arm][steps[-1]])} runs)")
    left.set_ylim(-0.02, 1.05)
    left.set_ylabel("held-out success")
    right.set_ylabel("held-out tool calls / episode")
    for ax in (left, right):
        ax.set_xlabel("RL step")
    fig.suptitle(f"{task}, {size} model: greedy held-out evaluations, mean ± SE over runs", fontsize=9)
    return _save(fig, right, path)


def report(records: list[dict]) -> str:
    parts = []
    if any(r["kind"] == "context" for r in records):
        parts += ["## Context managers\n", context_table(records), "\n### Seeds against builds\n",
                  variance_table(records), "\n### Success by summaries (selections) allowed at evaluation\n",
                  sweep_table(records)]
    if any(r["kind"] == "meta" for r in records):
        parts += ["\n## Learning across episodes\n", meta_table(records)]
    if any(r["kind"] == "training" for r in records):
        parts += ["\n## RL on an environment\n", training_table(records)]
        if any(r.get("heldout_curve") for r in records if r["kind"] == "training"):
            parts += ["\n### Against GRPO at a step both runs evaluated\n", step_table(records)]
    if any(r["kind"] == "selfplay" for r in records):
        parts += ["\n## Self-play and proposer-solver\n", selfplay_table(records)]
    parts += ["\n## Paired comparisons\n", contrasts(records)]
    return "\n".join(parts)


# The claims table: each claim of the seed papers against ctxrl's figure, RL's share and a verdict
# (``experiments/claims.toml`` says what each claim compares; ``experiments/stats.py`` computes the figures).

CONTEXT_RL_PAGE = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "context-rl.md"


def _fill_page(page: Path, tables: dict[str, str], write: bool) -> int:
    """Print ``tables`` as the page's blocks, or (``write``) put them into ``page``."""
    import context_rl

    if not write:
        print("\n\n".join(f"<!-- {name} -->\n{table}" for name, table in tables.items()))
        return 0
    page.write_text(context_rl.fill_page(page.read_text(), tables))
    print(f"wrote {page}'s generated blocks")
    return 0


def _context_rl(write: bool) -> int:
    """``context-rl``: the page's tables on stdout, or (``--write``) into the page, with its plot."""
    import context_rl

    _fill_page(CONTEXT_RL_PAGE, context_rl.page_tables(), write)
    if write:
        context_rl.plot(context_rl.DATA / "batch", CONTEXT_RL_PAGE.with_suffix(".png"))
    return 0


OFFPOLICY_PAGE = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "offpolicy.md"


def _offpolicy(write: bool) -> int:
    """``offpolicy``: the blocks of docs/experiments/offpolicy.md (issue 52)."""
    import offpolicy

    return _fill_page(OFFPOLICY_PAGE, offpolicy.page_tables(), write)


META_RL_PAGE = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "meta-rl.md"


def _meta_rl(write: bool) -> int:
    """``meta-rl``: the blocks of docs/experiments/meta-rl.md (issue 49's learning across episodes)."""
    import meta_rl

    return _fill_page(META_RL_PAGE, meta_rl.page_tables(), write)


ENVIRONMENTS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def _repo_tasks(write: bool) -> int:
    """``repo-tasks``: the measured blocks of docs/environments.md's repo_tasks section (issue 56)."""
    import repo_tasks_page

    return _fill_page(ENVIRONMENTS_PAGE, repo_tasks_page.page_tables(), write)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="read batch directories into a JSON file of records (appends)")
    c.add_argument("batches", nargs="+", type=Path)
    c.add_argument("--machine", required=True, help="a label for the machine that built these runs' models")
    c.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("report", help="markdown tables (and plots) from collected records")
    r.add_argument("records", type=Path)
    r.add_argument("--plots", type=Path, default=None, help="write PNGs here")
    cr = sub.add_parser("context-rl", help="the tables and plot of docs/experiments/context-rl.md (issue 49)")
    cr.add_argument("--write", action="store_true", help="fill the page's blocks and draw its plot")
    op = sub.add_parser("offpolicy", help="the tables of docs/experiments/offpolicy.md (issue 52)")
    op.add_argument("--write", action="store_true", help="fill the page's blocks")
    mr = sub.add_parser("meta-rl", help="the tables of docs/experiments/meta-rl.md (issue 49, meta-RL)")
    mr.add_argument("--write", action="store_true", help="fill the page's blocks")
    rt = sub.add_parser("repo-tasks", help="the measured tables of docs/environments.md's repo_tasks (issue 56)")
    rt.add_argument("--write", action="store_true", help="fill the page's blocks")
    k = sub.add_parser("claims", help="the claims table (markdown page) from a claims file and committed records")
    k.add_argument("claims", type=Path)
    k.add_argument("--write", action="store_true", help="write the page the claims file names, not stdout")
    args = parser.parse_args(argv)
    if args.command == "context-rl":
        return _context_rl(args.write)
    if args.command == "repo-tasks":
        return _repo_tasks(args.write)
    if args.command == "offpolicy":
        return _offpolicy(args.write)
    if args.command == "meta-rl":
        return _meta_rl(args.write)
    if args.command == "claims":
        from claims import claims_page

        text = claims_page(args.claims)
        if not args.write:
            print(text, end="")
            return 0
        page = args.claims.parent / tomllib.loads(args.claims.read_text())["page"]
        page.write_text(text)
        print(f"wrote {os.path.normpath(page)}")
        return 0
    if args.command == "collect":
        missing = [str(b) for b in args.batches if not (b / "runs").is_dir()]
        if missing:
            raise SystemExit(f"not batch directories (no runs/ inside): {', '.join(missing)}")
        old = json.loads(args.out.read_text()) if args.out.is_file() else []
        skipped: list[str] = []
        new = collect_batches(args.batches, args.machine, skipped)
        for line in skipped:
            print(f"skipped {line}", file=sys.stderr)
        keep = [o for o in old if (o["machine"], o["name"]) not in {(n["machine"], n["name"]) for n in new}]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(keep + new, indent=1))
        print(f"{len(new)} records from {len(args.batches)} batch(es); {len(keep) + len(new)} in {args.out}")
        return 0
    skipped = []
    records = load_records(args.records, skipped)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    print(report(records))
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)
        for task, size in sorted({(x["task"], x["size"]) for x in records if x["kind"] == "context"}):
            plot_context(records, args.plots / f"context-{task}-{size}.png", task=task, size=size)
            plot_limits(records, args.plots / f"limits-{task}-{size}.png", task=task, size=size)
        for task in sorted({x["task"] for x in records if x["kind"] == "context"}):
            plot_ladder(records, args.plots / f"ladder-{task}.png", task=task)
        for task, size in sorted({(x["task"], x["size"]) for x in records if x["kind"] == "training"}):
            plot_training(records, args.plots / f"training-{task}-{size}.png", task=task, size=size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
