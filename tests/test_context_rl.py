"""docs/experiments/context-rl.md is what ``experiments/tables.py context-rl`` makes of its committed records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    sys.path.insert(0, str(ROOT / "experiments"))
    spec = importlib.util.spec_from_file_location("context_rl", ROOT / "experiments" / "context_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
