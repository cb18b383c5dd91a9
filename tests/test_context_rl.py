"""docs/experiments/context-rl.md is what ``experiments/tables.py context-rl`` makes of its committed records."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import experiment_module

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return experiment_module("context_rl")


def test_the_pages_tables_without_resampling_are_its_records():
    """The blocks that need no bootstrap (the default run's check; the whole page is the slow test below)."""
    context_rl = _module()
    data = context_rl.DATA
    text = (ROOT / "docs" / "experiments" / "context-rl.md").read_text()
    cheap = {"ceilings": context_rl.ceilings_table(data / "ceilings-fact_hunt.json"),
             "limits": context_rl.eval_limits_table(data / "evals"),
             "fmt34": context_rl.fmt34_table(data / "batch-fmt34"),
             "own34-calibration": context_rl.own34_calibration_table(data),
             "own34-content": context_rl.own34_content_table(data),
             "own34-stopping": context_rl.own34_stopping_table(data)}
    assert context_rl.fill_page(text, cheap) == text, "regenerate it: python experiments/tables.py context-rl --write"


@pytest.mark.slow  # (27-42 s of bootstrap resamples on 2 cores)
def test_the_page_holds_the_tables_its_records_give(tmp_path):
    context_rl = _module()
    page = ROOT / "docs" / "experiments" / "context-rl.md"
    text = page.read_text()
    assert context_rl.fill_page(text, context_rl.page_tables()) == text, \
        "regenerate it: python experiments/tables.py context-rl --write"
    png = context_rl.plot(context_rl.DATA / "batch", tmp_path / "curves.png")
    assert png.stat().st_size > 10_000


def test_every_arm_has_five_seeds_and_the_successes_fall_where_the_page_says():
    import json

    context_rl = _module()
    records = json.loads((context_rl.DATA / "runs.json").read_text())
    arms = context_rl.arm_records(records)
    assert sorted(arms) == sorted(context_rl.ARMS.values())
    assert all([r["seed"] for r in runs] == [0, 1, 2, 3, 4] and all(r["steps"] == 100 for r in runs)
               for runs in arms.values())
    for runs in arms.values():
        solved, two, unclear, _ = context_rl.successes_by_trail(runs)
        assert solved == two + unclear and unclear <= 1  # every success is a two-page trail, but one the id hides


def test_a_page_without_a_block_is_refused():
    context_rl = _module()
    with pytest.raises(ValueError, match="no block <!-- arms -->"):
        context_rl.fill_page("no blocks here", {"arms": "| table |"})
    # a new page's empty block is filled as an old one is refilled
    empty = "# page\n<!-- arms -->\n<!-- /arms -->\ntail\n"
    assert context_rl.fill_page(empty, {"arms": "| t |"}) == "# page\n<!-- arms -->\n| t |\n<!-- /arms -->\ntail\n"
    assert context_rl.fill_page(context_rl.fill_page(empty, {"arms": "| t |"}), {"arms": "| u |"}) == \
        "# page\n<!-- arms -->\n| u |\n<!-- /arms -->\ntail\n"
