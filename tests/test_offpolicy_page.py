"""docs/experiments/offpolicy.md is what ``experiments/tables.py offpolicy`` makes of issue 52's records, and the
page's own measures (a collapse, the Fisher exact test) by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import experiment_module, page_block

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "experiments" / "offpolicy.md"


def _module():
    return experiment_module("offpolicy")


def test_fisher_exact_by_hand():
    op = _module()
    # 0 of 5 against 5 of 5: only the split seen and its mirror are as unlikely, each 1 / C(10, 5) = 1/252
    assert op.fisher_exact(0, 5, 5, 5) == pytest.approx(2 / 252)
    # 1 of 5 against 5 of 5 (6 of 10 in all): P(k) = C(5,k) C(5,6-k) / 210; k = 1 and 5 are 5/210 each, k = 2, 4 50/210
    assert op.fisher_exact(1, 5, 5, 5) == pytest.approx(10 / 210)
    assert op.fisher_exact(2, 4, 2, 4) == pytest.approx(1.0)


def test_a_collapse_is_a_fall_below_half_after_reaching_nine_tenths():
    op = _module()

    def rows(*successes):
        return [{"phase": "rl", "step": i + 1, "success": s} for i, s in enumerate(successes)]

    assert op.collapsed(rows(0.2, 0.95, 0.4, 0.9)) == 3
    assert op.collapsed(rows(0.2, 0.3, 0.4, 0.1)) is None  # never reached 0.9: low, not collapsed
    assert op.collapsed(rows(0.9, 0.5, 0.6)) is None  # 0.5 is not below 0.5
    assert op.collapsed([{"phase": "eval", "step": 1, "success": 0.0}, *rows(0.95, 0.1)]) == 2


def test_every_run_finished_and_the_cheap_blocks_are_the_records():
    """The status, stability and mismatch blocks (no bootstrap) as the records give them; the whole page is the
    slow test below."""
    op = _module()
    arms = op.runs()
    assert list(arms) == list(op.ARMS.values())
    assert all([seed for seed, _ in runs] == [0, 1, 2, 3, 4] for runs in arms.values())
    text = PAGE.read_text()
    for name, make in (("offpolicy-status", op.status), ("offpolicy-stability", op.stability_table),
                       ("offpolicy-mismatch", op.mismatch_table)):
        assert page_block(text, name) == make(), \
            f"regenerate it: python experiments/tables.py offpolicy --write ({name})"
    assert "every arm finished, 5 seeds each" in op.status()


@pytest.mark.slow  # (about a minute of bootstrap resamples)
def test_the_page_holds_what_the_records_give():
    op = _module()
    from context_rl import fill_page

    text = PAGE.read_text()
    assert fill_page(text, op.page_tables()) == text, "regenerate it: python experiments/tables.py offpolicy --write"
