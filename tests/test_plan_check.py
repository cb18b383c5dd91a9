"""``experiments/plan_check.py``: a comparison whose baseline cannot win by construction, or whose control is not
the arm's SFT-only control, is refused before any GPU time (issue 49)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _plan_check():
    spec = importlib.util.spec_from_file_location("plan_check", ROOT / "experiments" / "plan_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(tmp_path: Path, model: str, *, window: int, control_extra: str = "", eval_seeds: bool = True,
          baseline_extra: str = "") -> Path:
    common = "--env fact_hunt --steps 2 --model {m} --out {out}"
    limits = "env.max_turns=6 rollout.max_total_tokens=1024 rollout.max_new_tokens=32"
    runs = []
    for seed in (0, 1):
        ev = limits + (f" eval.seed={100 + seed}" if eval_seeds else "")
        runs += [f'[[run]]\nname = "fh1-b0-s{seed}-summarize400"\ncmd = "python benchmarks/env_training.py {common} '
                 f'--seed {seed} {ev} context.manager=summarize context.max_context_tokens=400"\n',
                 f'[[run]]\nname = "fh1-b0-s{seed}-summarize400-sftonly"\ncmd = "python benchmarks/env_training.py '
                 f'{common} --seed {seed} {ev} context.manager=summarize context.max_context_tokens=400 '
                 f'train.objective=sft {control_extra}"\n',
                 f'[[run]]\nname = "fh1-b0-s{seed}-window{window}"\ncmd = "python benchmarks/env_training.py '
                 f'{common} --seed {seed} {ev} context.manager=window context.max_context_tokens={window} '
                 f'{baseline_extra}"\n']
    text = (f'[models]\nm = "{model}"\n\n' + "\n".join(runs) +
            f'\n[[compare]]\nclaim = "summarize beats window"\narm = "fh1-b0-s{{seed}}-summarize400"\n'
            f'baseline = "fh1-b0-s{{seed}}-window{window}"\ncontrol = "fh1-b0-s{{seed}}-summarize400-sftonly"\n'
            'seeds = [0, 1]\npeak_matched = true\n')
    path = tmp_path / f"plan-{window}.toml"
    path.write_text(text)
    return path


def test_a_baseline_that_cannot_win_and_a_window_below_the_peak_are_refused(tmp_path, tiny_path, capsys):
    check = _plan_check()
    assert check.main([str(_plan(tmp_path, tiny_path, window=340)), "--tasks", "8"]) == 2
    out = capsys.readouterr().out
    assert "cannot win by construction" in out and "below the arm's scripted peak" in out
    assert "0 of 1 comparisons may run" in out


def test_a_fair_comparison_passes_a_changed_control_not(tmp_path, tiny_path, capsys):
    check = _plan_check()
    assert check.main([str(_plan(tmp_path, tiny_path, window=600)), "--tasks", "8"]) == 0
    assert "1 of 1 comparisons may run" in capsys.readouterr().out
    assert check.main([str(_plan(tmp_path, tiny_path, window=600, control_extra="sft.lr=0.1")), "--tasks", "8"]) == 2
    assert "is not the SFT-only control" in capsys.readouterr().out
    assert check.main([str(_plan(tmp_path, tiny_path, window=600, eval_seeds=False)), "--tasks", "8"]) == 2
    assert "same held-out tasks" in capsys.readouterr().out
    assert check.main([str(_plan(tmp_path, tiny_path, window=600, control_extra="train.lr=3e-5")), "--tasks", "8"]) == 0
    capsys.readouterr()  # a control at another rate is still the arm's control
    assert check.main([str(_plan(tmp_path, tiny_path, window=600, baseline_extra="eval.seed=7")), "--tasks", "8"]) == 2
    assert "evaluate different held-out tasks" in capsys.readouterr().out


def test_a_pilot_whose_baseline_was_decided_by_the_warm_start_is_refused(tmp_path, tiny_path, capsys):
    import json

    pilot = tmp_path / "pilot.json"
    pilot.write_text(json.dumps([{"name": f"fh1-b0-s{s}-window600", "heldout_before": 1.0} for s in (0, 1)]))
    check = _plan_check()
    assert check.main([str(_plan(tmp_path, tiny_path, window=600)), "--tasks", "8", "--pilot", str(pilot)]) == 2
    assert "decided it before RL" in capsys.readouterr().out


@pytest.mark.parametrize("plan", ["issue49.toml", "issue49b.toml"])
def test_the_issue49_plans_pass_their_own_check_at_tiny_size(plan, tiny_path):
    """The committed plans parse, name runs that exist and controls that are controls (budgets are SmolLM2's, so
    only the structure is checked here: the tiny tokenizer's lengths differ)."""
    check = _plan_check()
    comparisons, configs = check.load_comparisons(ROOT / "experiments" / "plans" / plan, {"m": tiny_path})
    for c in comparisons:
        for seed in c["seeds"]:
            arm, control = c["arm"].format(seed=seed), c["control"].format(seed=seed)
            assert check.control_difference(configs[arm], configs[control]) == []


def test_ceilings_sweeps_managers_and_budgets(tmp_path, tiny_path):
    import json

    spec = importlib.util.spec_from_file_location("ceilings", ROOT / "experiments" / "ceilings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "ceilings.json"
    assert module.main(["--model", tiny_path, "--managers", "full,window,summarize", "--budgets", "340,480,64",
                        "--tasks", "6", "--out", str(out)]) == 0
    records = {(r["manager"], r["budget"]): r for r in json.loads(out.read_text())}
    assert records[("full", None)]["ceiling"] == 1.0
    assert records[("window", 340)]["ceiling"] == 0.0  # the opening and one page: the first code is lost
    assert records[("summarize", 480)]["ceiling"] > records[("window", 480)]["ceiling"]
    assert "must exceed rollout.max_new_tokens" in records[("window", 64)]["error"]  # a budget no turn fits
