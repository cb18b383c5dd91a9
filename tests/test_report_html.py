"""The HTML report (``ctxrl report``): its structure parsed from a synthetic run and a real tiny one, escaping, the
comparison of two runs, no network at view time, and a screenshot in headless Chromium where it is installed."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ctxrl.cli import main
from ctxrl.report.html import messages_of, render, write_report

EVIL = "<script>alert('x')</script>"


class Page(HTMLParser):
    """The elements of a page: tags with their attributes and ancestry, and each text with its enclosing tags."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.elements: list[tuple[str, dict, list[str]]] = []
        self.texts: list[tuple[str, list[tuple[str, dict]]]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs, [t for t, _ in self.stack]))
        if tag not in ("meta", "br", "hr", "img", "input", "link"):  # HTML void elements never close
            self.stack.append((tag, attrs))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), [t for t, _ in self.stack]))

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:  # (an unclosed element ends with its parent)
                break

    def handle_data(self, data):
        self.texts.append((data, list(self.stack)))

    def tags(self, tag: str, cls: str | None = None) -> list[dict]:
        return [a for t, a, _ in self.elements if t == tag and (cls is None or cls in (a.get("class") or "").split())]

    def text_in(self, cls: str) -> str:
        return "".join(d for d, stack in self.texts if any(cls in (a.get("class") or "").split() for _, a in stack))


def spans(*pairs: tuple[int, str]) -> list[dict]:
    return [{"mask": m, "text": t} for m, t in pairs]


EPISODE_SPANS = spans(
    (0, "<|im_start|>system\nUse the calculator.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"),
    (1, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'),
    (0, "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    (1, f"{EVIL}<answer>5</answer><|im_end|>"),
)


def fake_run(run_dir: Path, *, reward_shift: float = 0.0) -> Path:
    """A run directory as ``RunWriter`` leaves it: metrics of 6 steps, evaluations at 0, 3, 6; two samples."""
    run_dir.mkdir(parents=True)
    rows = [{"phase": "sft", "step": 0, "sft_loss_last": 0.1}]
    for split in ("train", "heldout", "ood"):
        rows.append({"phase": "eval", "step": 0, "split": split, "success": 0.2, "tool_calls": 0.5})
    for step in range(1, 7):
        rows.append({"phase": "rl", "step": step, "reward": 0.1 * step + reward_shift, "success": 0.1 * step,
                     "tool_calls": 1.0 + step / 10, "tool_errors": 0.0, "entropy": 1.0 / step, "approx_kl": 0.01,
                     "clip_frac_low": 0.0, "clip_frac_high": 0.02, "tokens": 400, "trained_sequences": 4,
                     "sampled_tokens": 30.0, "context_peak_tokens_mean": 120.0 + step,
                     "summaries_per_episode": 0.5, "success_without_summary": "nan"})
        if step % 3 == 0:
            for split in ("train", "heldout", "ood"):
                rows.append({"phase": "eval", "step": step, "split": split, "success": 0.1 * step, "tool_calls": 1.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"phase": "rl", "st')
    samples = [
        {"step": 6, "phase": "rl", "task_id": "calculator-1", "split": "train", "prompt": f"What is 2+3? {EVIL}",
         "answer": "5", "reward": 1.0, "success": True, "tool_calls": 1, "tokens": 60, "sampled_tokens": 20,
         "spans": EPISODE_SPANS,
         "segments": [{"ended_by": "summary", "tokens": 40,
                       "spans": spans((0, "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"),
                                      (1, "So far: nothing computed.<|im_end|>"))}]},
        {"step": 6, "phase": "eval-heldout", "task_id": "calculator-2", "split": "heldout", "prompt": "1+1",
         "answer": "2", "reward": 0.0, "success": False, "tool_calls": 0, "tokens": 30, "sampled_tokens": 5,
         "spans": spans((0, "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"), (1, "3<|im_end|>")),
         "segments": []},
    ]
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (run_dir / "config.toml").write_text('[env]\nname = "calculator"\n')
    return run_dir


def check_no_network(page: Page) -> None:
    for _, attrs, _ in page.elements:
        for name in ("src", "href"):
            assert not str(attrs.get(name, "")).lower().startswith(("http:", "https:", "//")), attrs
    assert not page.tags("script") and not page.tags("link")


def test_one_run_page_structure(tmp_path: Path) -> None:
    path = write_report(fake_run(tmp_path / "a"))
    assert path == tmp_path / "a" / "report.html"
    page = Page(path.read_text())
    check_no_network(page)
    charts = page.tags("svg", "chart")
    titles = [a["aria-label"] for a in charts]
    for title in ("Success by split", "Reward (training rollouts)", "Tool calls per episode",
                  "Context length per episode", "Context rewrites per episode", "entropy", "approx kl",
                  "Clip fractions"):
        assert title in titles, titles
    assert "kl" not in titles  # not logged: no empty chart for it
    # evaluations are points (one per evaluated step and split), training rollouts a curve
    heldout = [a for t, a, _ in page.elements if t == "g" and a.get("data-series") == "heldout: greedy evaluation"]
    assert heldout
    points = [a for t, a, parents in page.elements if t == "circle" and "eval-point" in a.get("class", "")]
    assert len(points) >= 3 * 3 * 2  # success and tool calls: 3 splits x 3 evaluations each
    assert [a for a in page.tags("polyline") if a.get("data-series") == "training rollouts (sampled)"]
    assert not [a for a in page.tags("polyline") if "evaluation" in a.get("data-series", "")]
    # the sample episodes: a conversation with both masks, tool calls and results, the summary's sequence
    assert len(page.tags("details", "episode")) == 2
    assert page.tags("span", "mask1") and page.tags("span", "mask0")
    assert page.tags("div", "role-tool-call") and page.tags("div", "role-tool-result")
    assert page.tags("div", "ended-summary")
    assert "So far: nothing computed." in page.text_in("mask1")
    assert '"expression": "2+3"' in page.text_in("role-tool-call")
    # model output stays text: the script tag is data inside a mask-1 span, never an element
    assert EVIL in page.text_in("mask1")
    assert EVIL in page.text_in("task")
    assert "<script>" not in path.read_text()
    assert not page.tags("section", "comparison")


def test_messages_keep_every_character_with_its_mask() -> None:
    messages = messages_of(EPISODE_SPANS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    pieces = [p for m in messages for p in m["pieces"]]
    assert "".join(t for t, _ in pieces) == "".join(s["text"] for s in EPISODE_SPANS)
    # the masks, character by character, are the spans'
    masks = "".join(str(s["mask"]) * len(s["text"]) for s in EPISODE_SPANS)
    assert "".join(str(m) * len(t) for t, m in pieces) == masks
    assert messages_of(spans((1, "plain text, no template"))) == [{"role": "text", "pieces": [("plain text, no "
                                                                                                "template", 1)]}]


def test_two_runs_are_compared(tmp_path: Path, capsys) -> None:
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b", reward_shift=0.3)
    out = tmp_path / "compare.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    page = Page(out.read_text())
    check_no_network(page)
    assert page.tags("section", "comparison")
    compared = [a["aria-label"] for t, a, parents in page.elements if t == "svg" and "section" in parents][:5]
    assert "Reward" in compared
    reward = [a for a in page.tags("polyline") if a.get("data-series") in ("a", "b")]
    assert {a["data-series"] for a in reward} == {"a", "b"}
    table = page.tags("table", "final")
    assert len(table) == 1
    assert "heldout success" in page.text_in("final") and "0.600" in page.text_in("final")
    assert len(page.tags("section", "run")) == 2


def test_report_of_a_missing_run_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err


@pytest.mark.slow  # (17 s: a whole ctxrl train run; every default-suite run writes its report at each evaluation,
# and the page's parts are checked on synthetic runs above)
def test_a_real_tiny_run_writes_its_report(tmp_path: Path) -> None:
    """``ctxrl train`` on the random-init tiny model leaves a report.html with its evaluations and episodes."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "ctxrl.cli", "train",
                           str(Path(__file__).parents[1] / "examples" / "calculator_tiny.toml"), "--run-dir",
                           str(run_dir), "--steps", "2", "train.eval_every=1", "model.name=tiny:pretrain_steps=0",
                           "sft.demos=8", "sft.epochs=1", "sft.batch_size=4", "eval.tasks=2",
                           "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
                           "run.progress=false"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = Page((run_dir / "report.html").read_text())
    check_no_network(page)
    # evaluations at 0, 1 (eval_every) and 2 (the end) on held-out; train and OOD at 0 and 2
    heldout = [a for t, a, parents in page.elements if t == "circle" and "eval-point" in a.get("class", "")]
    assert len(heldout) >= 3
    assert page.tags("details", "episode") and page.tags("span", "mask1") and page.tags("span", "mask0")
    assert render([run_dir]) == (run_dir / "report.html").read_text()  # the end's page is of the whole run
    # the page's evaluation table holds the figures the CLI printed (to its two decimals), split by split
    import re

    html = (run_dir / "report.html").read_text()
    table = html[html.index('<table class="evaluation">'):]
    table = table[:table.index("</table>")]
    for split in ("train", "heldout", "ood"):
        printed = next(line for line in proc.stdout.splitlines() if line.strip("│ ").startswith(split + " "))
        cli = [float(c) for c in printed.split("│")[2:4]]
        page_row = re.search(rf"<tr><td>{split}</td><td>([^<]+)</td><td>([^<]+)</td>", table)
        assert page_row, (split, table)
        assert [round(float(v), 2) for v in page_row.groups()] == cli, (split, printed, page_row.groups())


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of a non-interlaced 8-bit PNG, with no imaging library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0
    channels = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * channels, [], bytearray(width * channels)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, channels, rows


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium, chromium-browser or google-chrome on PATH "
                    "(Debian: apt-get install chromium)")
def test_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    """The page as a browser draws it: charts (coloured curves and points) at the top, an episode's masks below."""
    path = write_report(fake_run(tmp_path / "a"))
    shot = tmp_path / "shot.png"
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                           "--window-size=1000,2600", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stderr[-2000:]
    width, channels, rows = _png_pixels(shot)

    def coloured(row: bytes) -> int:  # pixels that are neither white nor grey: curves, points, mask highlights
        return sum(1 for x in range(0, width * channels, channels)
                   if max(row[x:x + 3]) - min(row[x:x + 3]) > 40)

    charts = sum(coloured(r) for r in rows[100:700])
    assert charts > 500, charts  # the palette's curves and evaluation points
    green = sum(1 for r in rows[1200:] for x in range(0, width * channels, channels)
                if tuple(r[x:x + 3]) == (0xb7, 0xe4, 0xb0))
    assert green > 200, green  # mask-1 spans of the open episode (#b7e4b0)


def meta_run(run_dir: Path, *, lr: float = 1e-4) -> Path:
    """A meta-RL run as ``RunWriter`` leaves it: trials of 3 attempts, greedy evaluations at 0 and 4 whose success
    (0.36 on train at the end) differs from the last step's sampled rollouts (0.078), a KL of float noise."""
    run_dir.mkdir(parents=True)
    rows = [{"phase": "sft", "step": 0, "sft_loss_last": 0.1}]
    for step in (0, 4):
        for split, success in (("train", 0.1 + 0.065 * step), ("heldout", 0.05 + 0.05 * step)):
            rows.append({"phase": "eval", "step": step, "split": split, "success": success, "tool_calls": 1.0,
                         "errored": 0.0 if step else 0.02, "success_by_1": success, "success_by_2": success + 0.1,
                         "success_by_3": success + 0.15, "pass_at_1": success, "pass_at_2": success + 0.05,
                         "pass_at_3": success + 0.08,
                         "task_success_by_attempt": {"t1": [0.0, 1.0, 1.0], "t2": [0.0, 0.0, 1.0]}})
        if step == 0:
            for s in range(1, 5):
                rows.append({"phase": "rl", "step": s, "success": 0.078 if s == 4 else 0.1, "reward": 0.2,
                             "tool_calls": 1.0, "error_rate": 0.25 if s == 2 else 0.0, "entropy": 1.2,
                             "approx_kl": 1e-13 * (s % 2), "success_by_1": 0.1, "success_by_2": 0.2,
                             "success_by_3": 0.1 * s, "pass_at_1": 0.1, "pass_at_2": 0.15})
    rows.sort(key=lambda r: (r["step"], r["phase"] != "rl"))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.toml").write_text(f'[env]\nname = "hidden_word"\n[meta]\nnum_attempts = 3\n[rollout]\n'
                                         f'temperature = 0.7\n[train]\nlr = {lr}\n[eval]\ntemperature = 0.0\n')
    return run_dir


def test_report_names_greedy_evaluation_apart_from_training_rollouts(tmp_path: Path) -> None:
    """The CLI's before/after figures (greedy) are on the page as the CLI prints them, beside, and named apart from,
    the last step's sampled rollouts; meta-RL's success by attempt, pass@k and the error rate have their panels."""
    page = Page(write_report(meta_run(tmp_path / "m")).read_text())
    evaluation = page.text_in("evaluation")
    assert "greedy evaluation" in evaluation and "ctxrl train" in evaluation
    # train: 0.100 after the warm start, 0.360 at the end (what `ctxrl train` prints), change +0.260
    assert "0.100" in evaluation and "0.360" in evaluation and "+0.260" in evaluation
    rollouts = page.text_in("rollouts")
    assert "sampled at T=0.7" in rollouts and "not an evaluation" in rollouts and "0.078" in rollouts
    assert "0.360" not in rollouts and "0.078" not in evaluation
    titles = [a["aria-label"] for a in page.tags("svg", "chart")]
    for title in ("Errored episodes (fraction)", "Success by attempt k (a success among attempts 1..k)",
                  "pass@k of independent first attempts"):
        assert title in titles, titles
    attempts = page.text_in("attempts")
    assert "success by attempt 3" in attempts and "pass@3, independent" in attempts
    assert "heldout (step 4)0.2500.3500.400" in attempts  # 0.25, then +0.1, +0.15 by attempts 2 and 3
    # the training series carry an EMA behind the checkbox; evaluations stay points
    assert page.tags("input") and page.tags("polyline", "smoothed") and page.tags("polyline", "raw")
    assert not [a for a in page.tags("polyline", "smoothed") if "eval" in a.get("data-series", "")]
    # a KL of float noise is drawn flat, not as a trend from 0 to 1e-13
    kl = [(t, a, p) for t, a, p in page.elements if t == "svg" and a.get("aria-label") == "approx kl"]
    assert kl
    kl_svg = write_report(tmp_path / "m").read_text().split('aria-label="approx kl"')[1].split("</svg>")[0]
    assert "flat: every value 0" in kl_svg
    ys = {pt.split(",")[1] for pt in kl_svg.split('points="')[1].split('"')[0].split()}
    assert len(ys) == 1, ys


def test_compare_page_shows_the_settings_that_differ(tmp_path: Path) -> None:
    a, b = meta_run(tmp_path / "a"), meta_run(tmp_path / "b", lr=3e-4)
    page = Page(write_report([a, b], tmp_path / "c.html").read_text())
    diff = page.text_in("config-diff")
    assert "train.lr" in diff and "0.0001" in diff and "0.0003" in diff
    assert "env.name" not in diff  # the same in both
    assert len(page.tags("table", "evaluation")) == 2  # each compared run's CLI figures too


def test_chart_hygiene() -> None:
    """Tick labels and the y title do not overlap; long legend names are not clipped by the chart's edge."""
    from ctxrl.report.svg import CHAR_PX, Series, line_chart

    svg = line_chart([Series("a series with a very long name that cannot fit half of the chart's width at all",
                             [(0, 1e-5), (1, 2.5e-5), (2, 1.2e-5)]),
                      Series("b", [(0, 2e-5), (1, 1e-5), (2, 3e-5)])], title="t", y_label="value")
    page = Page(svg)
    ticks = [a for a in page.tags("text", "tick") if a.get("text-anchor") == "end"]
    tick_right = float(ticks[0]["x"])
    longest = max(len(d) for d, stack in page.texts if any("tick" in (a.get("class") or "") for _, a in stack))
    assert tick_right - longest * CHAR_PX >= 12 + 6  # the rotated y title is centred at x=12, 11 px high
    width = float(page.tags("svg")[0]["width"])
    for d, stack in page.texts:
        if any("legend" in (a.get("class") or "") for _, a in stack) and not any(t == "title" for t, _ in stack):
            x = float(next(a for t, a in stack if t == "text")["x"])
            assert x + len(d) * CHAR_PX <= width, (d, x)
