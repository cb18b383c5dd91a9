"""docs/experiments/meta-rl.md is what ``experiments/tables.py meta-rl`` makes of issue 49's meta-RL records, and the
page's per-task figures by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import experiment_module, page_block

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "experiments" / "meta-rl.md"


def test_a_tasks_figures_come_from_its_trials_by_hand():
    """4 sampled trials of 3 attempts: attempt 1 is the first attempts' share; by attempt 3 the logged share solved
    within 3; pass@3 of the 4 independent first attempts is 1 - C(4-c, 3) / C(4, 3)."""
    mr = experiment_module("meta_rl")
    row = {"task_success": {"a": 0.0, "b": 0.25, "c": 0.5, "d": 1.0},
           "task_success_by_attempt": {"a": [0.0, 0.25, 0.5], "b": [0.25, 0.5, 0.5], "c": [0.5, 0.5, 1.0],
                                       "d": [1.0, 1.0, 1.0]}}
    f = mr.task_figures(row)
    assert f["attempt 1"] == row["task_success"]
    assert f["by attempt 3"] == {"a": 0.5, "b": 0.5, "c": 1.0, "d": 1.0}
    # c = 0: no correct sample; c = 1: 1 - C(3,3)/C(4,3) = 3/4; c >= 2: any 3 of 4 hold a correct one
    assert f["pass@3"] == pytest.approx({"a": 0.0, "b": 0.75, "c": 1.0, "d": 1.0})


def test_the_cheap_blocks_are_the_records_and_the_arms_meet_at_step_40():
    """The status and work blocks (no bootstrap) as the records give them; the whole page is the slow test below."""
    mr = experiment_module("meta_rl")
    arms = mr.runs()
    assert list(arms) == list(mr.ARMS.values())
    assert all([seed for seed, _ in found] == [0, 1, 2, 3, 4] for found in arms.values())
    assert mr.common_step() == 40  # the meta arm's runs were stopped at steps 57-60, before their step-60 evaluation
    text = PAGE.read_text()
    for name, make in (("meta-rl-status", mr.status), ("meta-rl-work", mr.work_table)):
        assert page_block(text, name) == make(), f"regenerate it: python experiments/tables.py meta-rl --write ({name})"
    assert "compared there" in mr.status() and "at step 40" in mr.status()


@pytest.mark.slow  # (about 70 s of pure-Python bootstrap on 2 cores)
def test_the_whole_page_is_its_generator():
    mr = experiment_module("meta_rl")
    from context_rl import fill_page

    text = PAGE.read_text()
    assert fill_page(text, mr.page_tables()) == text, "regenerate it: python experiments/tables.py meta-rl --write"
