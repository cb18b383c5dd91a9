"""Smoke test of experiments/meta.py: both experiments run end to end on the random-init tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "meta.py"


@pytest.fixture(scope="module")
def experiment():
    spec = importlib.util.spec_from_file_location("experiment_meta", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reflection_experiment_smoke(experiment, tmp_path):
    out = tmp_path / "reflection"
    summary = experiment.main(["reflection", "--smoke", "--arms", "warm,icrl,meta", "--sampled", "2",
                               "--trial-demos", "0.5", "--out", str(out), "meta.reflection_max_tokens=64"])
    assert set(summary["arms"]) == {"warm", "icrl", "meta"} and summary["attempts"] == 2
    warm_rows = [json.loads(x) for x in (out / "warm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["trial_demos"] for r in warm_rows if r["phase"] == "sft"] == [4]  # half of the smoke's 8 demos
    for arm, result in summary["arms"].items():
        heldout = result["heldout"]
        assert {"success", "success_at_2", "success_by_2", "trial_success", "attempts"} <= set(heldout), arm
        assert {"pass_at_2", "independent_success_at_2"} <= set(result["sampled"])
    # every arm starts from the one saved warm start
    warm = summary["arms"]["warm"]["checkpoint"]
    assert summary["arms"]["icrl"]["checkpoint"] == warm
    assert f'name = {json.dumps(warm)}' in (out / "meta" / "config.toml").read_text()
    rows = [json.loads(x) for x in (out / "meta" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["phase"] == "rl" and "reflections_per_trial" in r for r in rows)
    assert "| meta |" in (out / "tables.md").read_text() and (out / "reflection.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="already holds runs"):
        experiment.main(["reflection", "--smoke", "--out", str(out)])
    # summarize: the mean over runs (here the same run twice) with the per-run values, and the plot
    table = experiment.main(["summarize", str(out), str(out), "--out", str(tmp_path / "both")])["table"]
    success = summary["arms"]["meta"]["heldout"]["success"]
    assert "2 runs" in table and f"| meta | {success:.2f} ({success:.2f}, {success:.2f}) |" in table
    assert (tmp_path / "both" / "reflection.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="directories of reflection runs"):
        experiment.aggregate([{"experiment": "demos"}])
    with pytest.raises(SystemExit, match=f"no summary.json in {tmp_path}"):
        experiment.main(["summarize", str(out), str(tmp_path)])


def test_demos_experiment_smoke(experiment, tmp_path):
    out = tmp_path / "demos"
    summary = experiment.main(["demos", "--smoke", "--out", str(out)])
    assert summary["env"] == "python_math" and set(summary["arms"]) == {"none", "annealed"}
    rl = [json.loads(x) for x in (out / "annealed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["demos_per_episode"] for r in rl if r["phase"] == "rl"] == [1.0]  # step 0 of a 1-step fade
    config = (out / "none" / "config.toml").read_text()
    assert "[meta.demos]\nmax = 0" in config and "[sft]\nenabled = false" in config
    assert "| annealed |" in (out / "tables.md").read_text()
