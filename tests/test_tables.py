"""experiments/tables.py and stats.py: records from batch runs, means with standard errors, paired comparisons,
plots; bootstrap intervals, paired tests and the claims table."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import tomllib


def _load(file: str):
    """A module of experiments/ by its path (experiments/ is not a package), under its file's stem."""
    name = Path(file).stem
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "experiments" / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


stats = _load("stats.py")
tables = _load("tables.py")
claims = _load("claims.py")
S = stats.SeedOutcome


def context_run(batch: Path, name: str, manager: str, before: float, after: float, budget: int | None) -> None:
    run = batch / "runs" / name
    (run / manager).mkdir(parents=True)
    (run / manager / "config.toml").write_text(f"[context]\nmax_context_tokens = {budget or 0}\n")
    summary = {"heldout_before": before, "heldout_after": after, "ood_after": 0.0, "peak_context": 300,
               "summaries_per_episode": 1.0 if manager == "summarize" else 0.0}
    if manager == "summarize":
        summary |= {"heldout_by_eval_summaries": {"0": 0.1, "2": after}, "ood_by_eval_summaries": {"0": 0.0, "2": 0.0}}
    (run / "summary.json").write_text(json.dumps({manager: summary}))


def training_run(batch: Path, name: str, calls: float, success: float) -> None:
    run = batch / "runs" / name / "python_math-s0"
    run.mkdir(parents=True)
    rows = [{"phase": "sft", "step": 0, "sft_loss_last": 0.25},
            {"phase": "eval", "split": "heldout", "step": 0, "success": 0.0, "tool_calls": 0.0}]
    rows += [{"phase": "rl", "step": i, "tool_calls": 9.0 if i < 5 else calls, "void_turn_rate": 0.1,
              "grad_norm": 0.5 + i / 100} for i in range(20)]
    rows += [{"phase": "eval", "split": "heldout", "step": 20, "success": success, "tool_calls": calls}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def meta_run(batch: Path, name: str, single_gain: float, meta_gain: float) -> None:
    run = batch / "runs" / name
    run.mkdir(parents=True)
    arms = {arm: {"heldout": {"success": 0.1, "success_by_3": 0.1 + gain, "success_at_3": 0.05}}
            for arm, gain in (("single", single_gain), ("meta", meta_gain))}
    (run / "summary.json").write_text(json.dumps({"experiment": "reflection", "attempts": 3, "steps": 5, "arms": arms}))


@pytest.fixture
def records(tmp_path):
    batch = tmp_path / "batch"
    for seed, (w, s) in enumerate(((0.2, 0.6), (0.3, 0.5), (0.1, 0.7))):
        context_run(batch, f"fh26-b1-s{seed}-window320", "window", w, w, 320)
        context_run(batch, f"fh26-b1-s{seed}-summarize320", "summarize", s, s, 320)
    context_run(batch, "fh26-b1-s0-full", "full", 1.0, 0.9, None)
    training_run(batch, "pm5-b0-s0-grpo", 1.2, 0.5)
    training_run(batch, "pm5-b0-s0-otc", 1.0, 0.5)
    meta_run(batch, "cb26-b0-s0", 0.1, 0.3)
    (batch / "runs" / "not-a-plan-name").mkdir()
    (batch / "runs" / "fh26-b1-s9-window320").mkdir()  # a run that wrote nothing: skipped
    context_run(batch, "fh26-b1-s0-window320-lr2e-5", "window", 0.3, 0.4, 320)  # the same arm, another setting
    context_run(batch, "fh26-b1-s0-summarize320-lr2e-5", "summarize", 0.5, 0.5, 320)
    out = tmp_path / "records.json"
    assert tables.main(["collect", str(batch), "--machine", "m1", "--out", str(out)]) == 0
    return json.loads(out.read_text()), out


def test_collect_reads_each_kind_of_run_with_its_build_seed_and_budget(records):
    recs, _ = records
    kinds = sorted((r["kind"], r["arm"]) for r in recs if not r["variant"])
    assert kinds.count(("context", "window")) == 3 and ("context", "full") in kinds
    assert ("training", "otc") in kinds and ("meta", "meta") in kinds and ("meta", "single") in kinds
    window = next(r for r in recs if r["name"] == "fh26-b1-s1-window320")
    assert (window["task"], window["size"], window["build"], window["seed"], window["budget"], window["variant"]) == \
        ("fact_hunt", "26M", "m1/b1", 1, 320, None)
    variant = next(r for r in recs if r["name"] == "fh26-b1-s0-window320-lr2e-5")
    assert (variant["arm"], variant["budget"], variant["variant"], variant["heldout_after"]) == \
        ("window", 320, "lr2e-5", 0.4)
    otc = next(r for r in recs if r["arm"] == "otc")
    assert otc["train_calls_last10"] == 1.0 and otc["heldout_after"] == 0.5 and otc["steps"] == 20
    assert otc["sft_loss_last"] == 0.25
    assert math.isclose(otc["grad_norm_max"], 0.69)


def test_means_standard_errors_and_paired_differences_are_hand_checked(records):
    recs, _ = records
    assert tables.mean_se([0.6, 0.5, 0.7]) == pytest.approx((0.6, 0.1 / math.sqrt(3)))
    mean, se = tables.mean_se([0.4])
    assert mean == 0.4 and math.isnan(se)  # one value has no error estimate
    # summarize - window per seed: 0.4, 0.2, 0.6 -> mean 0.4, sd 0.2, se 0.2/sqrt(3)
    m, se, n = tables.paired(recs, "context", "heldout_after", "summarize", "window", budget=320)
    assert (n, m, se) == (3, pytest.approx(0.4), pytest.approx(0.2 / math.sqrt(3)))
    m, se, n = tables.paired(recs, "training", "train_calls_last10", "otc", "grpo")
    assert (n, m) == (1, pytest.approx(-0.2)) and math.isnan(se)
    text = tables.report(recs)
    assert "| fact_hunt | 26M | summarize | 320 | 3 | 0.60 ± 0.06 |" in text
    assert "python_math 5.2M: otc − grpo | train_calls_last10 | 1 | -0.20 (one pair: no error estimate) |" in text
    assert "codebreak 26M: meta − single | gain | 1 | +0.20 (one pair: no error estimate) |" in text
    assert "0: 0.10, 2: 0.60" in text  # the evaluation-time summary sweep
    # a variant is its own row and is paired only with the same variant: 0.5 - 0.4
    assert "| fact_hunt | 26M | window lr2e-5 | 320 | 1 | 0.30 | 0.40 |" in text
    assert "| fact_hunt 26M, budget 320 (lr2e-5): summarize − window | heldout_after | 1 | +0.10 (one pair" in text
    assert "| fact_hunt 26M, budget 320: summarize − window | heldout_after | 3 | +0.40 ± 0.12 |" in text


def test_each_manager_of_a_run_gets_its_own_budget(tmp_path):
    batch = tmp_path / "batch"
    context_run(batch, "fh26-b0-s0", "window", 0.2, 0.2, 320)
    (batch / "runs" / "fh26-b0-s0" / "full").mkdir()
    (batch / "runs" / "fh26-b0-s0" / "full" / "config.toml").write_text("[context]\nmax_context_tokens = 0\n")
    summary = json.loads((batch / "runs" / "fh26-b0-s0" / "summary.json").read_text())
    summary["full"] = {"heldout_before": 1.0, "heldout_after": 1.0, "ood_after": 0.0}
    (batch / "runs" / "fh26-b0-s0" / "summary.json").write_text(json.dumps(summary))
    budgets = {r["arm"]: r["budget"] for r in tables.collect(batch, "m")}
    assert budgets == {"window": 320, "full": None}


def test_collecting_again_replaces_records_and_reports_write_plots(records, tmp_path):
    recs, out = records
    batch = tmp_path / "batch"
    assert tables.main(["collect", str(batch), "--machine", "m1", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())) == len(recs)  # the same runs, not twice
    assert tables.main(["report", str(out), "--plots", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "context-fact_hunt-26M.png").stat().st_size > 0
    assert (tmp_path / "png" / "ladder-fact_hunt.png").stat().st_size > 0
    assert (tmp_path / "png" / "limits-fact_hunt-26M.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="not batch directories"):
        tables.main(["collect", str(tmp_path), "--machine", "m1", "--out", str(out)])


def test_a_run_repeated_in_a_later_batch_replaces_the_earlier_one(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    context_run(first, "fh26-b0-s0-summarize352", "summarize", 0.0, 0.1, 352)  # say its sweep failed for memory
    context_run(first, "fh26-b0-s0-window352", "window", 0.0, 0.2, 352)
    meta_run(first, "cb26-b0-s0", 0.1, 0.2)  # one run, one record per arm
    context_run(second, "fh26-b0-s0-summarize352", "summarize", 0.0, 0.5, 352)
    meta_run(second, "cb26-b0-s0", 0.1, 0.4)
    out = tmp_path / "records.json"
    assert tables.main(["collect", str(first), str(second), "--machine", "m1", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert sorted((r["name"], r["arm"]) for r in recs) == [
        ("cb26-b0-s0", "meta"), ("cb26-b0-s0", "single"),
        ("fh26-b0-s0-summarize352", "summarize"), ("fh26-b0-s0-window352", "window")]
    assert {r["arm"]: r.get("heldout_after", r.get("gain")) for r in recs}["summarize"] == 0.5
    assert {r["arm"]: r.get("gain") for r in recs}["meta"] == pytest.approx(0.4)
    err = capsys.readouterr().err
    assert f"skipped fh26-b0-s0-summarize352 of an earlier batch: {second} ran it again" in err
    assert f"skipped cb26-b0-s0 of an earlier batch: {second} ran it again" in err


def test_a_context_run_cut_short_after_rl_is_read_from_its_metrics_and_others_are_named(tmp_path, capsys):
    """A run whose evaluation-time sweep failed has no summary.json, but its RL and the evaluation after it
    finished: its record comes from metrics.jsonl, with the sweep's finished limits. One stopped during RL
    is skipped, and collect says why."""
    batch = tmp_path / "batch"

    def cut_run(name, manager, last_step):
        run = batch / "runs" / name / manager
        run.mkdir(parents=True)
        (run / "config.toml").write_text("[context]\nmax_context_tokens = 352\n[train]\nsteps = 40\n")
        rows = [{"phase": "eval", "step": step, "split": split, "success": success,
                 "summaries_per_episode": 0.7, "context_peak_tokens_max": 340.0}
                for step, success in ((0, 0.5), (last_step, 0.6)) for split in ("train", "heldout", "ood")]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    cut_run("fh26-b0-s0-summarize352", "summarize", 40)
    for limit, heldout, splits in ((0, 0.4, ("heldout", "ood")), (2, 0.6, ("heldout", "ood")), (3, 0.6, ("heldout",))):
        sweep = batch / "runs" / "fh26-b0-s0-summarize352" / f"summarize-eval-{limit}"  # 3 was cut off mid-way
        sweep.mkdir()
        rows = [{"phase": "eval", "step": 40, "split": split, "success": heldout if split == "heldout" else 0.1}
                for split in splits]
        (sweep / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cut_run("fh26-b0-s1-summarize352", "summarize", 20)  # an evaluation mid-RL is not "after RL"
    (batch / "runs" / "odd name").mkdir()
    (batch / "runs" / "fh26-b0-s2-window352x").mkdir()  # no arm parses: not read as a variant of nothing
    context_run(batch, "fh26-b0-s3-window352", "window", 0.1, 0.1, 352)
    (batch / "runs" / "fh26-b0-s3-window352" / "summary.json").write_text("{not json")  # a broken file
    out = tmp_path / "records.json"
    assert tables.main(["collect", str(batch), "--machine", "m1", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert (record["kind"], record["arm"], record["budget"], record["heldout_before"], record["heldout_after"],
            record["ood_after"], record["summaries_per_episode"], record["heldout_by_eval_summaries"]) == \
        ("context", "summarize", 352, 0.5, 0.6, 0.6, 0.7, {"0": 0.4, "2": 0.6})
    assert record["ood_by_eval_summaries"] == {"0": 0.1, "2": 0.1}
    err = capsys.readouterr().err
    assert "skipped fh26-b0-s1-summarize352: stopped before its evaluation after RL" in err
    assert "skipped odd name: not a TASK SIZE-bBUILD-sSEED" in err
    assert "skipped fh26-b0-s2-window352x: not a TASK SIZE-bBUILD-sSEED" in err
    assert "skipped fh26-b0-s3-window352: could not be read (JSONDecodeError" in err
    for name, variant in (("fh26-b1-s0-select352-lr2e-5", "lr2e-5"), ("sj26-b0-s0-full-sft6", "sft6"),
                          ("pm5-b0-s0-grpo", None), ("fh26-b0-s0", None)):
        assert tables.NAME.match(name)["variant"] == variant
    assert tables.NAME.match("fh26-b0-s0-select352-") is None and tables.NAME.match("fh26-b0-s0-select352--x") is None


def test_success_by_evaluation_limit_is_averaged_over_the_runs_that_reached_every_limit():
    def run(seed, arm, heldout, ood, variant=None):
        return {"kind": "context", "task": "fact_hunt", "size": "26M", "arm": arm, "variant": variant, "budget": 352,
                "build": "m/b0", "seed": seed, "heldout_by_eval_summaries": heldout, "ood_by_eval_summaries": ood}

    records = [run(0, "select", {"0": 0.2, "3": 0.8, "8": 0.8}, {"0": 0.0, "3": 0.0, "8": 0.6}),
               run(1, "select", {"0": 0.4, "3": 0.9, "8": 0.9}, {"0": 0.0, "3": 0.0, "8": 0.4}),
               run(2, "select", {"0": 0.9, "3": 0.9}, {"0": 0.5, "3": 0.5}),  # cut off before 8: left out
               run(3, "select", {"0": 0.9, "3": 0.9, "8": 0.9}, {"0": 0.5, "3": 0.5}),  # OOD cut off: left out
               run(0, "summarize", {"0": 0.1, "3": 0.5}, {"0": 0.0, "3": 0.3}, variant="lr2e-5"),
               {**run(1, "summarize", {}, {}), "heldout_by_eval_summaries": None},  # no sweep: not a curve
               {**run(0, "select", {"0": 1.0}, {"0": 1.0}), "task": "search_join"}]
    curves = tables.limit_curves(records, task="fact_hunt", size="26M")
    assert set(curves) == {"select, 352 (2 runs)", "summarize lr2e-5, 352 (1 run)"}
    heldout = curves["select, 352 (2 runs)"]["heldout"]
    assert [(k, n) for k, _, _, n in heldout] == [(0, 2), (3, 2), (8, 2)]
    # limit 0: mean (0.2 + 0.4) / 2 = 0.3, SD sqrt(0.02) = 0.1414, SE 0.1414 / sqrt(2) = 0.1
    assert heldout[0][1:3] == pytest.approx((0.3, 0.1))
    assert heldout[1][1:3] == pytest.approx((0.85, 0.05))
    ood = curves["select, 352 (2 runs)"]["ood"]
    assert [p[1:3] for p in ood] == [(0.0, 0.0), (0.0, 0.0), pytest.approx((0.5, 0.1))]
    ood = curves["summarize lr2e-5, 352 (1 run)"]["ood"]  # one run: no error estimate
    assert [(k, m, n) for k, m, _, n in ood] == [(0, 0.0, 1), (3, 0.3, 1)] and all(math.isnan(p[2]) for p in ood)


def test_seed_and_build_spreads_are_hand_checked():
    # build a: 0.2, 0.4 (mean 0.3, squares 0.01 + 0.01); build b: 0.6, 0.7, 0.8 (mean 0.7, squares 0.01 + 0 + 0.01)
    within, between = tables.spread({"a": [0.2, 0.4], "b": [0.6, 0.7, 0.8]})
    assert within == pytest.approx(math.sqrt(0.04 / 3))  # 3 degrees of freedom
    assert between == pytest.approx(math.sqrt(0.08))  # sd of 0.3 and 0.7
    within, between = tables.spread({"a": [0.5]})
    assert math.isnan(within) and math.isnan(between)
    recs = [{"kind": "context", "task": "fact_hunt", "size": "26M", "arm": "select", "variant": None, "budget": 352,
             "build": build, "seed": i, "heldout_after": x}
            for build, xs in (("m/b1", (0.2, 0.4)), ("m/b2", (0.6, 0.7, 0.8))) for i, x in enumerate(xs)]
    assert "| fact_hunt | 26M | select | 352 | 2 | 5 | 0.12 | 3 | 0.28 |" in tables.variance_table(recs)


def test_every_run_of_the_kept_plans_is_named_so_that_tables_can_read_it():
    batch = sys.modules.get("batch")  # tests/test_batch.py may have loaded it
    if batch is None:
        spec = importlib.util.spec_from_file_location("batch", Path(__file__).parents[1] / "experiments" / "batch.py")
        batch = importlib.util.module_from_spec(spec)
        sys.modules["batch"] = batch  # its dataclasses look their module up
        spec.loader.exec_module(batch)
    plans = sorted((Path(__file__).parents[1] / "experiments" / "plans").glob("*.toml"))
    assert plans
    for plan in plans:
        runs = [job for job in batch.load_plan(plan, Path("/nonexistent")) if job.kind != "build"]
        assert runs, plan
        for job in runs:
            match = tables.NAME.match(job.name)
            assert match, f"{plan.name}: {job.name}"
            assert match["task"] in tables.TASKS and match["size"] in tables.SIZES, f"{plan.name}: {job.name}"


def test_arms_are_compared_with_grpo_at_a_step_both_runs_evaluated(tmp_path):
    """A run stopped early is read against its partner's evaluation at the same step, not at its partner's end."""
    batch = tmp_path / "batch"

    def run(name, curve):
        path = batch / "runs" / name / "python_math-s0"
        path.mkdir(parents=True)
        rows = [{"phase": "eval", "split": "heldout", "step": step, "success": success, "tool_calls": calls}
                for step, success, calls in curve]
        rows.insert(1, {"phase": "rl", "step": 0, "tool_calls": 2.0})
        (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    # build 0 seed 0: grpo stopped after its step-45 evaluation; otc reached step 60
    run("pm5-b0-s0-grpo-redundant", [(0, 0.5, 2.0), (15, 0.4, 2.0), (45, 0.6, 1.5)])
    run("pm5-b0-s0-otc-redundant", [(0, 0.5, 2.0), (15, 0.5, 1.0), (45, 0.5, 1.0), (60, 0.3, 1.0)])
    run("pm5-b0-s1-grpo-redundant", [(0, 0.5, 2.0), (15, 0.5, 2.0), (45, 0.5, 1.0), (60, 0.5, 1.0)])
    run("pm5-b0-s1-otc-redundant", [(0, 0.5, 2.0), (15, 0.7, 1.0), (45, 0.6, 1.0), (60, 0.6, 1.0)])
    run("pm5-b0-s2-otc-redundant", [(0, 0.5, 2.0), (15, 0.7, 1.0)])  # no grpo partner: not paired
    out = tmp_path / "records.json"
    assert tables.main(["collect", str(batch), "--machine", "m", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert next(r for r in recs if r["name"] == "pm5-b0-s0-grpo-redundant")["heldout_curve"][-1] == [45, 0.6, 1.5]
    last, steps, n = tables.paired_at_step(recs, "otc", "grpo", variant="redundant")
    # seed 0 at step 45: success 0.5 - 0.6 = -0.1, calls 1.0 - 1.5 = -0.5; seed 1 at step 60: +0.1, 0.0
    assert (n, sorted(steps)) == (2, [45, 60])
    assert last["success"] == pytest.approx((0.0, 0.1)) and last["calls"] == pytest.approx((-0.25, 0.25))
    first, steps, n = tables.paired_at_step(recs, "otc", "grpo", which="first", variant="redundant")
    # step 15: success +0.1 and +0.2, calls -1.0 and -1.0
    assert (n, steps) == (2, [15, 15])
    assert first["success"] == pytest.approx((0.15, 0.05)) and first["calls"] == pytest.approx((-1.0, 0.0))
    assert tables.paired_at_step(recs, "otc", "grpo")[2] == 0  # plain runs only unless a variant is named
    text = tables.report(recs)
    assert "| python_math 5.2M (redundant): otc − grpo | first | 15 | 2 | +0.15 ± 0.05 | -1.00 ± 0.00 |" in text
    assert "| python_math 5.2M (redundant): otc − grpo | last | 45, 60 | 2 | +0.00 ± 0.10 | -0.25 ± 0.25 |" in text
    # the curves the training plot draws: per arm, step -> (success, calls) of every run that evaluated there
    curves = tables.training_curves(recs, task="python_math", size="5.2M")
    assert set(curves) == {"grpo redundant", "otc redundant"}
    assert curves["otc redundant"][15] == [(0.5, 1.0), (0.7, 1.0), (0.7, 1.0)]
    assert curves["grpo redundant"][60] == [(0.5, 1.0)]
    assert tables.plot_training(recs, tmp_path / "t.png", task="python_math", size="5.2M").stat().st_size > 0
    assert tables.plot_training(recs, tmp_path / "none.png", task="search_qa", size="5.2M") is None


def test_first_step_keeps_what_rl_met_after_the_warm_start(tmp_path):
    """The first RL row's entropy and zero-variance groups (issue 31: a warm start that leaves RL nothing to do
    shows entropy near 0 and every group without variance); a run without RL rows gives None."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"phase": "sft", "step": 0}, {"phase": "eval", "step": 0, "split": "heldout", "success": 0.6},
            {"phase": "rl", "step": 1, "entropy": 0.012, "zero_variance_groups": 16},
            {"phase": "rl", "step": 2, "entropy": 0.3, "zero_variance_groups": 4}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tables.first_step(metrics) == {"entropy_first": 0.012, "zero_variance_first": 16}
    metrics.write_text(json.dumps(rows[0]) + "\n")
    assert tables.first_step(metrics) == {"entropy_first": None, "zero_variance_first": None}
    assert tables.first_step(tmp_path / "missing.jsonl") == {"entropy_first": None, "zero_variance_first": None}
    assert tables.NAME.match("fh135-b0-s2-summarize384-d1500lr1e-5").groupdict() == {
        "task": "fh", "size": "135", "build": "0", "seed": "2", "arm": "summarize", "budget": "384",
        "variant": "d1500lr1e-5"}


DATA = Path(__file__).parents[1] / "docs" / "experiments" / "data"
RECORD_FILES = sorted(p for p in DATA.rglob("*") if p.suffix in tables.RECORD_FILE_SUFFIXES)


@pytest.mark.parametrize("path", RECORD_FILES, ids=lambda p: str(p.relative_to(DATA)))
def test_every_committed_records_file_is_read_or_named_as_skipped(path):
    """``report`` crashed on the hand-made records of issues 36 and 37: ``KeyError: 'kind'`` on issue 36's list of
    runs and issue 37's SmolLM2 list, ``TypeError: string indices must be integers`` on the tiny-model Kuhn files
    (a JSON object, iterated as its keys). Every file is now read, or named in ``skipped`` with the reason, and
    the report over what was read does not crash."""
    skipped: list[str] = []
    records = tables.load_records(path, skipped)
    assert records or any(line.startswith(f"{path}: ") for line in skipped), path
    assert all(r["kind"] in tables.KINDS and "objective" in r and "heldout_tasks_after" in r for r in records)
    tables.report(records)


def test_the_hand_made_records_of_issues_36_and_37_are_read_as_runs():
    skipped: list[str] = []
    gym = tables.load_records(DATA / "issue36" / "runs.json", skipped)
    assert len(gym) == 8 and not skipped
    no_tool = next(r for r in gym if r["name"] == "csnt135-s1-warm")
    assert (no_tool["kind"], no_tool["task"], no_tool["size"], no_tool["seed"], no_tool["arm"], no_tool["variant"],
            no_tool["heldout_before"], no_tool["heldout_after"], no_tool["build"]) == \
        ("training", "reasoning_gym:chain_sum", "135M", 1, "warm", "notool", 0.37, 0.38, "issue36/b0")
    smol = tables.load_records(DATA / "issue37" / "selfplay-smollm2.json", skipped)
    kuhn = [r for r in smol if r["task"] == "kuhn_poker"]
    assert len(smol) == 6 and len(kuhn) == 3 and {r["arm"] for r in smol} == {"selfplay", "proposer"}
    s0 = next(r for r in kuhn if r["seed"] == 0)
    assert (s0["kind"], s0["size"], s0["win_rate_vs_random_before"], s0["win_rate_vs_random_after"],
            s0["win_rate_vs_nash_after"], s0["heldout_before"]) == ("selfplay", "135M", 0.39, 0.685, 0.625, 0.45)
    (tiny,) = tables.load_records(DATA / "issue37" / "kuhn_poker-tiny-s2.json", skipped)
    assert (tiny["task"], tiny["seed"], tiny["size"], tiny["win_rate_vs_random_before"]) == \
        ("kuhn_poker", 2, None, 0.305)
    assert not skipped
    tables.load_records(DATA / "issue38" / "judge_tune.json", skipped)
    assert skipped and skipped[0].startswith(f"{DATA / 'issue38' / 'judge_tune.json'}: not a records file")


def test_the_student_t_tail_matches_hand_checked_values():
    """Two-sided p of Student's t: the tables' 97.5% points give 0.05; df 1 (Cauchy) and df 2 have closed forms."""
    assert stats.student_t_two_sided_p(2.776, 4) == pytest.approx(0.05, abs=2e-4)
    assert stats.student_t_two_sided_p(12.706, 1) == pytest.approx(0.05, abs=2e-4)
    assert stats.student_t_two_sided_p(2.228, 10) == pytest.approx(0.05, abs=2e-4)
    assert stats.student_t_two_sided_p(1.96, 1e6) == pytest.approx(0.05, abs=2e-4)  # the normal limit
    for t in (0.3, 1.0, 4.0):
        assert stats.student_t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-10)
        assert stats.student_t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-10)
    assert stats.student_t_two_sided_p(0.0, 5) == 1.0 and stats.student_t_two_sided_p(math.inf, 5) == 0.0
    for x in (0.1, 0.5, 0.9):  # I_x(a, 1) = x^a, I_x(1, b) = 1 - (1 - x)^b
        assert stats.regularized_incomplete_beta(x, 3.0, 1.0) == pytest.approx(x ** 3, rel=1e-10)
        assert stats.regularized_incomplete_beta(x, 1.0, 2.5) == pytest.approx(1 - (1 - x) ** 2.5, rel=1e-10)


def test_the_paired_t_test_and_its_degenerate_cases():
    # differences 0.4, 0.2, 0.6: mean 0.4, sd 0.2, t = 0.4 / (0.2 / sqrt 3) = 2 sqrt 3, df 2: p = 1 - t / sqrt(t^2 + 2)
    t, df, p = stats.paired_t_test([0.4, 0.2, 0.6])
    assert (t, df) == (pytest.approx(2 * math.sqrt(3)), 2) and p == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(14))
    assert stats.paired_t_test([1.0, 1.0, 1.0]) == (math.inf, 2, 0.0)  # every seed the same difference
    assert stats.paired_t_test([-0.5, -0.5]) == (-math.inf, 1, 0.0)
    assert stats.paired_t_test([0.0, 0.0, 0.0]) == (0.0, 2, 1.0)
    for one_or_none in ([0.3], []):
        t, _, p = stats.paired_t_test(one_or_none)
        assert math.isnan(t) and math.isnan(p)


def test_the_exact_sign_flip_test_is_hand_checked():
    # 1, 2, 3: of the 8 sign patterns only +++ and --- reach |sum| 6
    assert stats.sign_flip_p([1.0, 2.0, 3.0]) == 0.25
    # 3, 1: sums 4, 2, -2, -4; |sum| >= 4 in two of four
    assert stats.sign_flip_p([3.0, 1.0]) == 0.5
    assert stats.sign_flip_p([1.0, -1.0]) == 1.0 and stats.sign_flip_p([0.0, 0.0]) == 1.0
    assert stats.sign_flip_p([0.1] * 5) == 0.0625 == stats.sign_flip_floor(5)  # the floor with five seeds
    assert stats.sign_flip_p([0.1] * 3) == 0.25 == stats.sign_flip_floor(3)
    assert stats.sign_flip_p([0.7]) == 1.0 and math.isnan(stats.sign_flip_p([]))
    with pytest.raises(ValueError, match="17 seeds"):
        stats.sign_flip_p([1.0] * 17)


def test_the_bootstrap_over_seeds_is_hand_checked():
    """Two seeds, seeds only: the resampled mean is 0, 0.5 or 1 with chances 1/4, 1/2, 1/4, so the 2.5% and 97.5%
    quantiles are 0 and 1."""
    interval = stats.bootstrap_difference([S(1.0), S(0.0)], [S(0.0), S(0.0)])
    assert interval == (0.5, 0.0, 1.0, 2, 0) and interval.seeds_only
    assert stats.bootstrap_mean([S(0.2), S(0.4)]) == (pytest.approx(0.3), 0.2, 0.4, 2, 0)
    # the two levels of a figure come from the same resamples as the figure itself
    difference, arm, baseline = stats.bootstrap_contrast([S(1.0), S(0.0)], [S(0.25), S(0.25)])
    assert (difference, arm, baseline) == ((0.25, -0.25, 0.75, 2, 0), (0.5, 0.0, 1.0, 2, 0), (0.25, 0.25, 0.25, 2, 0))
    # every seed the same difference: no spread to resample
    assert stats.bootstrap_difference([S(1.0)] * 3, [S(0.25)] * 3) == (0.75, 0.75, 0.75, 3, 0)
    one = stats.bootstrap_difference([S(0.9)], [S(0.1)])  # one seed, no tasks: no interval, not a zero-width one
    assert one.mean == pytest.approx(0.8) and math.isnan(one.low) and math.isnan(one.high) and one.n_seeds == 1
    none = stats.bootstrap_difference([], [])
    assert none.n_seeds == 0 and math.isnan(none.mean)
    with pytest.raises(ValueError, match="pair seed by seed"):
        stats.bootstrap_difference([S(1.0)], [])
    # relative: (1 - 2) / 2 on every seed; a zero baseline has no ratio
    assert stats.bootstrap_difference([S(1.0)] * 2, [S(2.0)] * 2, relative=True) == (-0.5, -0.5, -0.5, 2, 0)
    assert math.isnan(stats.bootstrap_difference([S(1.0)] * 2, [S(0.0), S(1.0)], relative=True).low)


def test_the_bootstrap_resamples_tasks_within_seeds_paired_by_task_id():
    # one seed, tasks a and b: the resampled task mean is 0, 0.5 or 1 (chances 1/4, 1/2, 1/4)
    interval = stats.bootstrap_difference([S(0.5, {"a": 1.0, "b": 0.0})], [S(0.0, {"a": 0.0, "b": 0.0})])
    assert interval == (0.5, 0.0, 1.0, 1, 2) and not interval.seeds_only
    # tasks pair by id: c has no partner and is left out; a and b differ by 1 each
    paired = stats.bootstrap_difference([S(1.0, {"a": 1.0, "b": 1.0, "c": 0.0}), S(1.0, {"a": 1.0, "b": 1.0})],
                                        [S(0.0, {"a": 0.0, "b": 0.0}), S(0.0, {"b": 0.0, "a": 0.0})])
    assert paired == (1.0, 1.0, 1.0, 2, 2)
    # the same seed means with and without task noise: seeds alone see no spread, seeds and tasks do
    noisy = [S(0.5, {str(i): float(i % 2) for i in range(10)}) for _ in range(3)]
    flat = [S(0.5, dict.fromkeys(map(str, range(10)), 0.5)) for _ in range(3)]
    seeds_only = stats.bootstrap_mean([S(0.5)] * 3)
    both = stats.bootstrap_mean(noisy)
    assert seeds_only == (0.5, 0.5, 0.5, 3, 0) and stats.bootstrap_mean(flat) == (0.5, 0.5, 0.5, 3, 10)
    assert both.low < 0.5 < both.high and both.n_tasks == 10
    assert both == stats.bootstrap_mean(noisy)  # seeded: a page regenerates to the same digits
    # a seed without per-task outcomes (an old record) sends every seed back to its mean, and says so
    mixed = stats.bootstrap_difference([noisy[0], S(0.5)], [S(0.0, dict.fromkeys(map(str, range(10)), 0.0)), S(0.0)])
    assert mixed.seeds_only and mixed == (0.5, 0.5, 0.5, 2, 0)
    # a record whose evaluation listed no tasks is a record without per-task outcomes
    assert stats.bootstrap_difference([S(1.0, {}), S(0.0, {})], [S(0.0, {}), S(0.0, {})]) == (0.5, 0.0, 1.0, 2, 0)
    # seeds that share no task id cannot pair by task either
    assert stats.bootstrap_difference([S(1.0, {"a": 1.0})], [S(0.0, {"b": 0.0})]).seeds_only


def test_verdicts_follow_the_documented_rules():
    I = stats.Interval  # noqa: E741
    big, small, across = I(0.5, 0.4, 0.6, 5, 60), I(0.1, 0.05, 0.15, 5, 60), I(0.1, -0.05, 0.25, 5, 60)

    def verdict(figure, share=None, direction="up", goal=0.3):
        return stats.verdict(figure, share, direction=direction, goal=goal)[0]

    assert verdict(big) == "no control"
    assert verdict(big, share=I(0.2, 0.1, 0.3, 5, 60)) == "reproduced"
    assert verdict(big, share=across) == "direction only"  # RL's share includes 0
    assert verdict(small, share=I(0.2, 0.1, 0.3, 5, 60)) == "direction only"  # below the size goal
    assert verdict(big, share=I(-0.1, -0.2, 0.0, 5, 60)) == "not reproduced"  # the warm start's effect
    assert verdict(across) == "not reproduced"
    assert verdict(I(-0.5, -0.6, -0.4, 5, 0), direction="down") == "no control"
    assert verdict(big, direction="down") == "not reproduced"
    assert verdict(I(0.0, 0.0, 0.0, 5, 0), direction="within", goal=0.03) == "reproduced"
    assert verdict(I(0.01, -0.05, 0.06, 5, 0), direction="within", goal=0.03) == "direction only"
    assert verdict(I(-0.13, -0.2, -0.05, 5, 0), direction="within", goal=0.03) == "not reproduced"
    assert verdict(I(0.8, math.nan, math.nan, 1, 0)) == "no interval"
    assert verdict(I(math.nan, math.nan, math.nan, 0, 0)) == "not run"
    assert stats.verdict(big._replace(n_seeds=3), None, direction="up", goal=0.3) == \
        ("no control", "direction and size met; RL's share not measured; pilot: 3 seeds")


def _write_rows(directory: Path, rows: list[dict], config: str = "") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "config.toml").write_text(config)


def _heldout(step: int, tasks: dict[str, float], **extra) -> dict:
    return {"phase": "eval", "split": "heldout", "step": step, "success": sum(tasks.values()) / len(tasks),
            "tool_calls": 1.0, "task_success": tasks, **extra}


def test_collect_reads_per_task_outcomes_the_objective_and_summary_retention(tmp_path):
    """Issue 49's eval rows: per-task success before and after, success by attempt per task for trials, summary
    retention for context runs; ``train.objective`` from the run's config (the SFT-only control's steps are
    ``sft_control`` rows, and it has no RL rows)."""
    runs = tmp_path / "batch" / "runs"
    rl_rows = [{"phase": "rl", "step": i, "tool_calls": 1.0, "grad_norm": 0.5} for i in range(1, 4)]
    _write_rows(runs / "pm135-b0-s0-grpo" / "python_math-s0",
                [_heldout(0, {"t1": 0.0, "t2": 0.5}), *rl_rows, _heldout(3, {"t1": 1.0, "t2": 0.5})])
    control_rows = [{"phase": "sft_control", "step": i, "sft_loss": 0.1} for i in range(1, 4)]
    _write_rows(runs / "pm135-b0-s0-grpo-ctl" / "python_math-s0",
                [_heldout(0, {"t1": 0.0, "t2": 0.5}), *control_rows, _heldout(3, {"t1": 0.0, "t2": 1.0})],
                config='[train]\nobjective = "sft"\n')
    context = runs / "fh135-b0-s0-summarize384"
    _write_rows(context / "summarize",
                [_heldout(0, {"a": 1.0}, fact_survival=0.5, fact_survival_rewrites=4.0, task_fact_survival={"a": 0.5}),
                 _heldout(30, {"a": 1.0}, summary_fact_retention=0.75, summaries_scored=8,
                          task_summary_retention={"a": 0.75})],
                config="[context]\nmax_context_tokens = 384\n")
    (context / "summary.json").write_text(json.dumps({"summarize": {"heldout_before": 1.0, "heldout_after": 1.0,
                                                                    "ood_after": 0.0}}))
    meta = runs / "hw135-b0-s0-meta"
    _write_rows(meta / "warm", [_heldout(0, {"w": 0.0}, task_success_by_attempt={"w": [0.0, 0.5, 0.5]})])
    _write_rows(meta / "meta", [_heldout(20, {"w": 1.0}, task_success_by_attempt={"w": [0.5, 1.0, 1.0]})])
    _write_rows(meta / "meta-sampled", [_heldout(0, {"w": 0.5}, task_success_by_attempt={"w": [0.25, 0.5, 0.75]})])
    arms = {arm: {"heldout": {"success": 0.1, "success_by_3": 0.4}} for arm in ("warm", "meta")}
    (meta / "summary.json").write_text(json.dumps({"experiment": "reflection", "attempts": 3, "steps": 20,
                                                   "arms": arms}))
    out = tmp_path / "records.json"
    assert tables.main(["collect", str(tmp_path / "batch"), "--machine", "m", "--out", str(out)]) == 0
    skipped: list[str] = []
    recs = {(r["name"], r["arm"]): r for r in tables.load_records(out, skipped)}
    assert not skipped
    grpo, control = recs["pm135-b0-s0-grpo", "grpo"], recs["pm135-b0-s0-grpo-ctl", "grpo"]
    assert (grpo["objective"], grpo["heldout_tasks_before"], grpo["heldout_tasks_after"]) == \
        ("rl", {"t1": 0.0, "t2": 0.5}, {"t1": 1.0, "t2": 0.5})
    assert (control["objective"], control["variant"], control["steps"], control["heldout_tasks_after"],
            control["train_calls_last10"], control["grad_norm_max"]) == \
        ("sft", "ctl", 3, {"t1": 0.0, "t2": 1.0}, None, None)
    summarize = recs["fh135-b0-s0-summarize384", "summarize"]
    assert (summarize["summary_retention_before"], summarize["summaries_scored_before"],
            summarize["summary_retention_tasks_before"]) == (0.5, 4.0, {"a": 0.5})  # ctxrl's names
    assert (summarize["summary_retention_after"], summarize["summaries_scored_after"],
            summarize["summary_retention_tasks_after"]) == (0.75, 8, {"a": 0.75})  # the issue's names
    warm, trained = recs["hw135-b0-s0-meta", "warm"], recs["hw135-b0-s0-meta", "meta"]
    assert warm["heldout_tasks_by_attempt_after"] == {"w": [0.0, 0.5, 0.5]} and warm["heldout_tasks_before"] is None
    assert trained["heldout_tasks_by_attempt_after"] == {"w": [0.5, 1.0, 1.0]}
    assert trained["sampled_tasks_by_attempt"] == {"w": [0.25, 0.5, 0.75]} and warm["sampled_tasks_by_attempt"] is None
    # the per-task outcomes behind each figure a claim may compare
    assert tables.task_outcomes(trained, "gain") == {"w": 0.5}
    assert tables.task_outcomes(trained, "attempt1") == {"w": 0.5}
    assert tables.task_outcomes(trained, "success_by_k_sampled") == {"w": 0.75}
    assert tables.task_outcomes(grpo, "heldout_before") == {"t1": 0.0, "t2": 0.5}
    assert tables.task_outcomes(grpo, "train_calls_last10") is None  # a figure of training, not of held-out tasks


def test_records_written_before_issue_49_read_the_new_fields_as_none(tmp_path):
    old = {"name": "pm5-b0-s0-grpo", "machine": "m", "task": "python_math", "size": "5.2M", "build": "m/b0",
           "seed": 0, "kind": "training", "arm": "grpo", "heldout_after": 0.5}  # no variant, no objective
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([old]))
    (record,) = tables.load_records(path, [])
    assert record["variant"] is None and all(record[f] is None for f in tables.OUTCOME_FIELDS)
    assert tables.task_outcomes(record, "heldout_after") is None


def _training_records(arm: str, per_seed: list[float], *, objective: str | None = None, variant: str | None = None,
                      tasks: int = 4) -> list[dict]:
    """Records of one arm, seed i held-out at ``per_seed[i]`` on every one of ``tasks`` tasks (tasks=0: none)."""
    return [{"name": f"pm135-b0-s{i}-{arm}" + (f"-{variant}" if variant else ""), "machine": "m",
             "task": "python_math", "size": "135M", "build": "m/b0", "seed": i, "variant": variant,
             "kind": "training", "arm": arm, "objective": objective,
             "heldout_after": value, "heldout_tasks_after": {f"t{j}": value for j in range(tasks)} if tasks else None}
            for i, value in enumerate(per_seed)]


def _claim(**fields) -> str:
    lines = ["[[claim]]"]
    for key, value in fields.items():
        lines.append(f"{key} = {json.dumps(value)}" if not isinstance(value, dict) else
                     f"{key} = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in value.items())} }}")
    return "\n".join(lines) + "\n"


def test_the_claims_table_from_a_tiny_claims_file(tmp_path):
    """Per-task records with an SFT-only control give an interval over seeds and tasks, RL's share and a verdict;
    old records give seeds only and no control; an arm with no records is 'not run'."""
    new = _training_records("otc", [1.0] * 5) + _training_records("grpo", [0.0, 0.1, 0.2, 0.3, 0.4]) + \
        _training_records("otc", [0.5] * 5, objective="sft", variant="sft")  # the control: its own name
    (tmp_path / "new.json").write_text(json.dumps(new))
    old = [{k: v for k, v in r.items() if k not in ("objective", "heldout_tasks_after")}
           for r in _training_records("otc", [0.6, 0.7, 0.8]) + _training_records("grpo", [0.1, 0.1, 0.2])]
    (tmp_path / "old.json").write_text(json.dumps(old))
    common = {"kind": "training", "arm": "otc", "baseline": "grpo", "field": "heldout_after",
              "where": {"task": "python_math", "size": "135M"}, "direction": "up", "why": "Because."}
    claims_file = tmp_path / "claims.toml"
    claims_file.write_text('page = "out/page.md"\nrecords_dir = "."\n\n' +
                      _claim(name="Per task", paper="a | b", records=["new.json"], goal=0.3, **common) +
                      _claim(name="Old", paper="p", records=["old.json"], **common) +
                      _claim(name="Nothing", paper="p", records=["old.json"], **{**common, "arm": "void"}))
    (tmp_path / "out").mkdir()
    assert tables.main(["claims", str(claims_file), "--write"]) == 0
    text = (tmp_path / "out" / "page.md").read_text()
    assert text == claims.claims_page(claims_file)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| claim")]
    assert len(rows) == 3 and all(row.count(" | ") == 5 for row in rows)  # the | in "a | b" is escaped

    # differences by seed 1.0, 0.9, 0.8, 0.7, 0.6: mean 0.8, sd sqrt(0.025), t = 0.8 / (sd / sqrt 5) = 11.31, df 4;
    # all five positive: the sign-flip floor 2 / 2^5
    spec = claims.claim_settings(tomllib.loads(claims_file.read_text())["claim"][0], 0)
    figures = claims.claim_figures(spec, new)
    assert figures.figure.mean == pytest.approx(0.8) and (figures.figure.n_seeds, figures.figure.n_tasks) == (5, 4)
    assert 0.6 <= figures.figure.low < 0.8 < figures.figure.high <= 1.0
    assert figures.share == (0.5, 0.5, 0.5, 5, 4)  # after RL 1.0 on every task, after the SFT-only control 0.5
    assert figures.t_test[:2] == (pytest.approx(0.8 / (math.sqrt(0.025) / math.sqrt(5))), 4)
    assert figures.sign_flip_p == 0.0625
    per_task, seeds_only, nothing = rows
    assert "**+0.80 [" in per_task and "+0.50 [+0.50, +0.50]; 5 seeds × 4 tasks" in per_task
    assert "t = +11.31, df 4" in per_task and "sign-flip p = 0.062" in per_task
    assert "**reproduced** (direction and size met; RL's share excludes 0). Because." in per_task
    assert "a \\| b" in per_task and "[new.json](../new.json)" in per_task
    assert "3 seeds, seeds only" in seeds_only and "no SFT-only control run" in seeds_only
    assert "**no control** (direction and size met; RL's share not measured; pilot: 3 seeds)" in seeds_only
    assert "| not run |" in nothing and "**not run**" in nothing
    assert "python experiments/tables.py claims" in text and "Fewer than 5 seeds is a pilot" in text
    assert "RL steps" not in text  # these records do not say how many steps their runs took


def test_a_claim_whose_filters_match_two_runs_of_one_seed_is_refused():
    records = _training_records("otc", [1.0], objective="sft", variant="sft") + \
        _training_records("otc", [0.7], objective="sft", variant="sft2")
    with pytest.raises(claims.ClaimError, match="otc \\(sft\\) has two records for m/b0 seed 0: "
                       "pm135-b0-s0-otc-sft and pm135-b0-s0-otc-sft2; narrow"):
        claims.seed_outcomes(records, kind="training", arm="otc", field="heldout_after", where={}, objective="sft")


def test_a_claims_file_that_cannot_be_read_says_which_claim_and_why():
    base = {"name": "c", "paper": "p", "records": [], "kind": "training", "arm": "otc", "field": "heldout_after",
            "direction": "up", "why": "w", "baseline": "grpo"}
    assert claims.claim_settings(base, 0)["baseline_field"] == "heldout_after"
    with pytest.raises(claims.ClaimError, match=r"claim 3 \(c\): unknown keys \['basline'\]"):
        claims.claim_settings({**base, "basline": "grpo"}, 2)
    with pytest.raises(claims.ClaimError, match=r"missing keys \['why'\]"):
        claims.claim_settings({k: v for k, v in base.items() if k != "why"}, 0)
    with pytest.raises(claims.ClaimError, match="direction 'higher'; choose from up, down, within"):
        claims.claim_settings({**base, "direction": "higher"}, 0)
    with pytest.raises(claims.ClaimError, match="compares the arm with itself"):
        claims.claim_settings({k: v for k, v in base.items() if k != "baseline"}, 0)
    with pytest.raises(claims.ClaimError, match="at_most 'maybe'; choose from not run"):
        claims.claim_settings({**base, "at_most": "maybe"}, 0)


def test_a_claim_held_to_a_weaker_verdict_says_so():
    """``at_most`` caps what the numbers' rule gives, and the row says the cap is there."""
    from stats import Interval

    claim = claims.claim_settings({"name": "c", "paper": "p", "records": [], "kind": "training", "arm": "rl",
                                   "field": "heldout_after", "baseline_field": "heldout_before", "direction": "up",
                                   "why": "A shortcut.", "goal": 0.1, "at_most": "direction only"}, 0)
    strong = Interval(0.3, 0.2, 0.4, 5, 60)
    figures = claims.ClaimFigures(strong, strong, Interval(0.0, 0.0, 0.0, 5, 60), strong, [0.3] * 5, [100],
                                  (9.0, 4, 0.001), 0.0625)
    row = claims.claim_row(claim, figures, [])
    assert "**direction only** (direction and size met" in row and "held to direction only" in row


def test_the_claims_page_is_what_the_generator_writes_from_the_committed_records():
    """docs/experiments/README.md cannot drift from the records: it is regenerated here and compared, and every
    link in it stays inside the repository and names a file that exists."""
    root = Path(__file__).parents[1]
    page = root / "docs" / "experiments" / "README.md"
    assert page.read_text() == claims.claims_page(root / "experiments" / "claims.toml"), \
        "regenerate it: python experiments/tables.py claims experiments/claims.toml --write"
    for target in re.findall(r"\]\(([^)]+)\)", page.read_text()):
        resolved = (page.parent / target).resolve()
        assert "://" not in target and resolved.is_relative_to(root) and resolved.exists(), target
