"""docs/environments.md's repo_tasks measurement is what ``experiments/tables.py repo-tasks`` makes of its records."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import experiment_module

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return experiment_module("repo_tasks_page")


def test_the_page_holds_what_the_records_give():
    page_module = _module()
    from context_rl import fill_page

    page = ROOT / "docs" / "environments.md"
    text = page.read_text()
    assert fill_page(text, page_module.page_tables()) == text, \
        "regenerate it: python experiments/tables.py repo-tasks --write"


def test_every_run_finished_and_the_arms_pair_seed_by_seed():
    page_module = _module()
    arms = page_module.read_runs()
    assert [[r["seed"] for r in runs] for runs in arms.values()] == [[0, 1, 2], [0, 1, 2]]
    assert {r["steps"] for runs in arms.values() for r in runs} == {60}
    # the page's reading of the records: nothing solved after the warm start, no held-out task solved after
    assert all(r["before"][s].value == 0 for runs in arms.values() for r in runs for s in page_module.SPLITS)
    assert all(r["after"]["heldout"].value == 0 for runs in arms.values() for r in runs)


def test_a_run_that_did_not_finish_is_named(tmp_path):
    page_module = _module()
    run = tmp_path / "runs" / "cut"
    (run / "repo_tasks-s0").mkdir(parents=True)
    source = page_module.DATA / "runs" / "repo135-s0-rl" / "repo_tasks-s0"
    (run / "repo_tasks-s0" / "config.toml").write_text((source / "config.toml").read_text())
    import gzip

    with gzip.open(source / "metrics.jsonl.gz", "rt") as f:
        head = [line for line in f][:3]
    with gzip.open(run / "repo_tasks-s0" / "metrics.jsonl.gz", "wt") as f:
        f.writelines(head)
    with pytest.raises(ValueError, match="no evaluation for"):
        page_module.read_run(run)
