"""``ctxrl report`` on damaged run directories (issue 51, finding 6): 10 of 16 damaged directories were tracebacks.

Each case below is one run directory damaged one way (a crash mid-write, a full disk, a copy gone wrong, a
hand edit); the page is written from what can be read, and what was skipped is named on the page and on
stderr, file and line. ``--out`` naming a folder is one clear line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxrl.cli import main
from ctxrl.errors import CtxrlError
from ctxrl.report.html import write_report

GOOD_ROWS = [{"phase": "rl", "step": s, "reward": 0.1 * s, "success": 0.1 * s} for s in range(1, 4)]
GOOD_SAMPLE = {"phase": "rl", "step": 3, "split": "train", "task_id": "t1", "reward": 1.0, "success": True,
               "spans": [{"mask": 0, "text": "<|im_start|>user\nhi"}, {"mask": 1, "text": "<|im_start|>assistant\n5"}]}


def lines(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def damage(run: Path, case: str) -> str:
    """Write a run directory damaged as ``case`` says; the skipped thing the report must name ("" for none)."""
    metrics, samples, config = run / "metrics.jsonl", run / "samples.jsonl", run / "config.toml"
    metrics.write_text(lines(*GOOD_ROWS))
    samples.write_text(lines(GOOD_SAMPLE))
    config.write_text('[run]\nname = "r"\n')
    if case == "truncated metrics":
        metrics.write_text(lines(*GOOD_ROWS) + '{"phase": "rl", "step": 4, "rew')
        return "metrics.jsonl: skipped 1 line"
    if case == "nan lines":
        metrics.write_text(lines(*GOOD_ROWS, '{"phase": "rl", "step": NaN, "reward": NaN}',
                                 {"phase": "rl", "step": 5, "reward": "nan"}))
        return ""
    if case == "non-json lines":
        metrics.write_text(lines(GOOD_ROWS[0], "hello", "[1, 2]", "42", GOOD_ROWS[1]))
        return "metrics.jsonl: skipped 3 lines"
    if case == "missing config":
        config.unlink()
        return ""
    if case == "binary metrics":
        metrics.write_bytes(lines(GOOD_ROWS[0]).encode() + bytes(range(256)) * 4 + b"\n" + lines(GOOD_ROWS[1]).encode())
        return "not UTF-8"
    if case == "binary samples":
        samples.write_bytes(b"\xff\xfe\x00garbage\x80\n" + lines(GOOD_SAMPLE).encode())
        return "samples.jsonl: skipped 1 line"
    if case == "binary config":
        config.write_bytes(b"\xff\xfe[run]\x80\n")
        return "config.toml"
    if case == "empty files":
        metrics.write_text("")
        samples.write_text("")
        config.write_text("")
        return ""
    if case == "bad spans":
        bad = [{**GOOD_SAMPLE, "spans": "not a list"}, {**GOOD_SAMPLE, "spans": [1, None, {"mask": "x", "text": 5}]},
               {**GOOD_SAMPLE, "spans": [{"mask": [1], "text": {"a": 1}}]}, {**GOOD_SAMPLE, "segments": "x"},
               {**GOOD_SAMPLE, "segments": [{"spans": 7, "ended_by": ["x"]}]}, {**GOOD_SAMPLE, "step": "three"},
               {**GOOD_SAMPLE, "step": 1e400}, {**GOOD_SAMPLE, "phase": ["rl"]}]
        samples.write_text(lines(*bad))
        return "samples.jsonl"
    if case == "huge line":
        huge = '{"phase": "rl", "x": "' + "a" * (20 << 20) + '"}\n'
        metrics.write_text(lines(GOOD_ROWS[0]) + huge + lines(GOOD_ROWS[1]))
        return "longer than"
    if case == "huge numbers":
        metrics.write_text(lines(*GOOD_ROWS, {"phase": "rl", "step": 9, "reward": 1e308},
                                 {"phase": "rl", "step": 10, "reward": -1e308}, '{"phase": "rl", "step": 1e999}',
                                 '{"phase": "rl", "step": ' + "9" * 5000 + "}"))
        return "metrics.jsonl: skipped 1 line: 1 not JSON"
    if case == "odd fields":
        metrics.write_text(lines(*GOOD_ROWS, {"phase": "eval", "split": ["x"], "step": 1, "success": 1},
                                 {"phase": "eval", "split": 3, "step": 1, "success": 1}, {"phase": 7, "step": 2}))
        return ""
    if case == "deep json":
        metrics.write_text(lines(*GOOD_ROWS) + "[" * 100_000 + "]" * 100_000 + "\n")
        return "metrics.jsonl: skipped 1 line"
    if case == "samples a directory":
        samples.unlink()
        samples.mkdir()
        return "samples.jsonl: cannot be read"
    if case == "no newline at all":
        metrics.write_text(json.dumps(GOOD_ROWS[0]))
        return ""
    if case == "crlf and bom":
        metrics.write_bytes(b"\xef\xbb\xbf" + lines(*GOOD_ROWS).replace("\n", "\r\n").encode())
        return ""
    raise AssertionError(case)


CASES = ["truncated metrics", "nan lines", "non-json lines", "missing config", "binary metrics", "binary samples",
         "binary config", "empty files", "bad spans", "huge line", "huge numbers", "odd fields", "deep json",
         "samples a directory", "no newline at all", "crlf and bom"]


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_run_directory_gives_a_page_and_names_what_it_skipped(tmp_path, capsys, case):
    run = tmp_path / "run"
    run.mkdir()
    skipped = damage(run, case)
    assert main(["report", str(run), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    err = capsys.readouterr().err
    if skipped:
        assert skipped in err and skipped in page, err
        assert "Traceback" not in err
    else:
        assert "skipped" not in err


def test_report_out_a_folder_or_in_a_missing_folder_is_one_clear_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    damage(run, "missing config")
    with pytest.raises(CtxrlError, match="is a folder"):
        write_report([run], tmp_path)
    assert main(["report", str(run), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a folder" in err and "report.html" in err
    with pytest.raises(CtxrlError, match="no folder"):
        write_report([run], tmp_path / "missing" / "page.html")
