"""Every config under examples/ loads and passes the checks ``ctxrl train`` runs before it loads a model; the starter
stays short; each signature feature's example trains one step (slow: it builds a run)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

from ctxrl.config import load_config
from ctxrl.run.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted([*ROOT.glob("examples/*.toml"), *ROOT.glob("examples/presets/*.toml")])
FEATURES = {"summarize_fact_hunt": "summaries_per_episode", "select_fact_hunt": "selections_per_episode",
            "fold_fact_hunt": "branches_per_episode", "meta_hidden_word": "success_by_1",
            "kuhn_poker_tiny": None, "distill_calculator": "teacher_kl", "judge_calculator": None,
            "starter": None}
"""Each example trained in the slow test, and a figure of its feature its RL row must hold."""
MADE_BEFORE = {"judge_calculator.toml": ["reward.judge.target=tiny"]}
"""Examples naming a directory that a command in their header makes first (the tuned judge): validated with a
model that needs no such command in its place."""


def test_the_feature_examples_exist():
    assert set(FEATURES) <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_example_config_is_valid(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # relative paths in a config (a judge's rubric) are read from where ctxrl runs
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # an example writes today's keys, not renamed ones
        config = load_config(path, MADE_BEFORE.get(path.name, []))
    preflight(config)


def test_the_judge_example_says_how_to_make_its_judge():
    text = (ROOT / "examples" / "judge_calculator.toml").read_text()
    config = load_config(ROOT / "examples" / "judge_calculator.toml")
    assert f"--save {config.settings_of('reward', 'judge').target}" in text and "experiments/judge_tune.py" in text


def test_the_starter_is_short():
    lines = (ROOT / "examples" / "starter.toml").read_text().splitlines()
    assert len(lines) <= 30
    settings = [line for line in lines if line.strip() and not line.lstrip().startswith(("#", "["))]
    assert len(settings) <= 6, settings


SMALL = ["run.progress=false", "run.samples_per_step=1", "sft.demos=8", "sft.epochs=1", "sft.batch_size=4",
         "eval.tasks=2", "rollout.tasks_per_step=2", "rollout.group_size=2", "train.eval_every=0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_example_trains_one_step(name, tiny_path, tmp_path, monkeypatch):
    """One RL step of each example on the random-init tiny model, everything else as the example says; the feature
    shows in the step's figures (a summary, a selection, a branch, trials, a teacher's KL)."""
    from ctxrl.train.trainer import train

    monkeypatch.chdir(ROOT)
    overrides = [f"model.name={json.dumps(tiny_path)}", *SMALL]
    if name == "distill_calculator":
        overrides.append(f"algo.distill.teacher={json.dumps(tiny_path)}")
    if name == "judge_calculator":  # the judge its header tunes, at the header's size
        import importlib.util

        spec = importlib.util.spec_from_file_location("judge_tune", ROOT / "experiments" / "judge_tune.py")
        judge_tune = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "judge_tune", judge_tune)  # (its dataclass looks its module up)
        spec.loader.exec_module(judge_tune)
        judge_tune.main(["--model", tiny_path, "--examples", "64", "--eval-examples", "16", "--steps", "20",
                         "--batch-size", "8", "--lr", "3e-3", "--max-tokens", "4", "--save", str(tmp_path / "judge")])
        overrides.append(f"reward.judge={json.dumps(str(tmp_path / 'judge'))}")
    if name == "meta_hidden_word":
        overrides.append("meta.eval_trials=2")
    config = load_config(ROOT / "examples" / f"{name}.toml", [*overrides, "train.steps=1"])
    train(config, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert len(rl) == 1 and "loss" in rl[0]
    if FEATURES[name]:
        assert FEATURES[name] in rl[0], sorted(rl[0])
    if name == "summarize_fact_hunt":  # the warm start shows the policy summaries to write
        assert next(r for r in rows if r.get("phase") == "sft")["demo_summaries_per_episode"] > 0
