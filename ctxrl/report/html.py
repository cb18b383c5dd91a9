"""One self-contained HTML page of one run, or a comparison of several: ``ctxrl report RUN_DIR [RUN_DIR ...]``.

Made only from a run directory's files (``metrics.jsonl``, ``samples.jsonl``, ``config.toml``; ``RunWriter`` writes
them), so it works on a finished run, a running one, or one copied from another machine. The page carries its CSS
and its charts (inline SVG, ``ctxrl.report.svg``): nothing is fetched when it is viewed, and it has no script.

What it shows: first the figures ``ctxrl train`` prints (each split's evaluation after the warm start and at the
end, greedy unless ``eval.temperature`` says otherwise), apart from the training rollouts' figures (sampled at
``rollout.temperature`` on a few tasks a step: a success unlike greedy evaluation's is expected, not a disagreement;
in the CPU demo the last step's was 0.078 where the greedy train split's was 0.36); success by split
over steps (training rollouts as a curve, evaluations as points), reward, tool calls, errored episodes, context
length and summaries per episode, success by attempt and pass@k where trials were played (meta-RL), entropy / KL /
clip fractions where logged; sample episodes as a conversation with the loss mask on the text (sampled, mask 1, vs
given, mask 0), tool calls and results, and each earlier sequence of a rewritten context (summaries, windows, folds,
attempts, reflections); with two or more runs, the curves overlaid, a table of final figures and the settings in
which their ``config.toml`` files differ. A checkbox shows the training curves smoothed (an EMA,
``ctxrl.report.svg.ema``) instead of raw, with CSS alone.

A damaged run directory (a crash mid-write, a full disk, a bad copy, a hand edit) is read as far as it can be, and
what was skipped is named on the page and on stderr, file by file: lines cut off, not UTF-8, not JSON, not an
object or longer than ``MAX_LINE_BYTES`` (never read whole into memory), sample episodes whose spans or segments
are not lists of objects, a file that cannot be read, a ``config.toml`` that is not UTF-8.

What it does not do: read checkpoints or load a model, tokenize (the spans' text is what the run decoded), or
trust any text: episode text is model output and is HTML-escaped everywhere.
"""

from __future__ import annotations

import json
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from collections.abc import Callable, Iterator
from html import escape
from pathlib import Path
from typing import IO, Any

from ctxrl.errors import CtxrlError
from ctxrl.report.svg import EMA_WEIGHT, PALETTE, Series, finite, line_chart

MAX_LINE_BYTES = 8 << 20
"""The longest log line read (a metrics row or a sample episode is far shorter); a longer one is skipped unread."""

EPISODES_PER_PHASE = 2
"""Sample episodes shown per phase (sft, rl, eval-heldout, ...): those of the phase's last logged step."""

POLICY_KEYS = ("entropy", "approx_kl", "kl", "clip_frac_low", "clip_frac_high", "logprob_mismatch", "grad_norm")
SEGMENT_MEANING = {
    "summary": "its last sampled text is the summary the next sequence starts from",
    "window": "old turns were dropped from the context",
    "select": "the policy chose which turns to keep",
    "fold": "a branch that returned its result to the parent",
    "attempt": "an earlier attempt at the task",
    "reflection": "a reflection on the attempt before, carried to the next",
    "template": "the chat template rewrote earlier turns",
    "edited": "the client edited the conversation",
}


class Run:
    """A run directory's logs, read once: metric rows by phase and the sample episodes."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        if not (self.dir / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{self.dir}/metrics.jsonl not found: is {self.dir} a run directory "
                                    "(ctxrl train --run-dir)?")
        self.name = self.dir.resolve().name
        self.skipped: list[str] = []
        """What could not be read, one line each (the module docstring)."""
        self.rows = self._log("metrics.jsonl")
        self.samples = self._log("samples.jsonl", sample_problem) if (self.dir / "samples.jsonl").exists() else []
        self.config = self._config()
        self.settings = _settings(self.config)
        """``config.toml`` as a table ({} when it is missing or not TOML)."""

    def _log(self, name: str, problem: Callable[[dict], str | None] | None = None) -> list[dict]:
        try:
            rows, skipped = read_jsonl(self.dir / name, problem)
        except OSError as exc:
            self.skipped.append(f"{name}: cannot be read ({exc.strerror or exc})")
            return []
        if skipped:
            self.skipped.append(f"{name}: {skipped}")
        return rows

    def _config(self) -> str:
        path = self.dir / "config.toml"
        if not path.exists():
            return ""
        try:
            data = path.read_bytes()
        except OSError as exc:
            self.skipped.append(f"config.toml: cannot be read ({exc.strerror or exc})")
            return ""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.skipped.append(f"config.toml: not UTF-8 (byte {exc.start}); shown with replacement characters")
            return data.decode("utf-8", errors="replace")

    def phase(self, phase: str) -> list[dict]:
        return [r for r in self.rows if r.get("phase") == phase]

    def curve(self, key: str, phase: str = "rl", split: str | None = None) -> list[tuple[float, float]]:
        """(step, value) of ``key`` in the rows of ``phase`` (and ``split``), leaving out non-finite values."""
        out = []
        for r in self.phase(phase):
            if split is not None and r.get("split") != split:
                continue
            x, y = finite(r.get("step")), finite(r.get(key))
            if x is not None and y is not None:
                out.append((x, y))
        return out

    def splits(self) -> list[str]:
        order = {"train": 0, "heldout": 1, "ood": 2}
        splits = {r.get("split", "") for r in self.phase("eval") if isinstance(r.get("split", ""), str)}
        return sorted(splits, key=lambda s: (order.get(s, 9), s))

    def setting(self, section: str, key: str, default: Any = None) -> Any:
        table = self.settings.get(section)
        return table.get(key, default) if isinstance(table, dict) else default

    def eval_kind(self) -> str:
        """How the run's evaluations sampled: "greedy evaluation" (``eval.temperature`` 0, the default)."""
        temperature = finite(self.setting("eval", "temperature", 0.0))
        return "greedy evaluation" if not temperature else f"evaluation sampled at T={temperature:g}"

    def rollout_kind(self) -> str:
        """How the training rollouts sampled: "training rollouts (sampled at T=0.7)"."""
        temperature = finite(self.setting("rollout", "temperature"))
        return "training rollouts" + (f" (sampled at T={temperature:g})" if temperature is not None else " (sampled)")

    def evaluations(self, split: str) -> list[dict]:
        return [r for r in self.phase("eval") if r.get("split") == split and finite(r.get("step")) is not None]

    def final(self) -> dict[str, float | None]:
        """The last figures: each split's last evaluated success (what ``ctxrl train`` prints as "after RL"), and the
        last training step's figures, named apart (the training rollouts sample; the evaluations are greedy)."""
        out: dict[str, float | None] = {}
        for split in self.splits():
            pts = self.curve("success", "eval", split)
            out[f"{split} success ({self.eval_kind().replace('evaluation', 'eval')}, last)"] = \
                pts[-1][1] if pts else None
        rl = self.phase("rl")
        last = rl[-1] if rl else {}
        out["steps"] = finite(last.get("step"))
        for key in ("success", "reward", "tool_calls", "error_rate", "entropy"):
            out[f"training rollouts: {key.replace('_', ' ')} (last step)"] = finite(last.get(key))
        return out


def _settings(text: str) -> dict:
    try:
        data = tomllib.loads(text) if text else {}
    except (tomllib.TOMLDecodeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def read_jsonl(path: Path, problem: Callable[[dict], str | None] | None = None) -> tuple[list[dict], str]:
    """The objects of a JSONL log, and what was skipped, as one phrase ("" for nothing): lines cut off (a crash, or
    a run still writing), not UTF-8, not JSON, not an object, longer than ``MAX_LINE_BYTES``, or refused by
    ``problem`` (which says why)."""
    rows, skipped = [], {}
    with open(path, "rb") as f:
        for number, line in enumerate(_lines(f), 1):
            row, why = _row(line, number == 1)
            if why is None and problem is not None:
                why = problem(row)
            if why is not None:
                skipped.setdefault(why, []).append(number)
            elif row is not None:
                rows.append(row)
    count = sum(len(numbers) for numbers in skipped.values())
    if not count:
        return rows, ""
    reasons = "; ".join(f"{len(n)} {why} ({'line' if len(n) == 1 else 'lines'} {_numbers(n)})"
                        for why, n in skipped.items())
    return rows, f"skipped {count} line{'s' if count > 1 else ''}: {reasons}"


def _lines(f: IO[bytes]) -> Iterator[bytes | None]:
    """The lines of ``f``, each read at most ``MAX_LINE_BYTES`` at a time: None for a longer one (the rest of it is
    read past in pieces, never held)."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = f.readline(1 << 20)
            yield None
            continue
        yield line


def _row(line: bytes | None, first: bool) -> tuple[dict | None, str | None]:
    """One line's object, or why it is skipped (None, None for a blank line)."""
    if line is None:
        return None, f"longer than {MAX_LINE_BYTES >> 20} MiB"
    try:
        text = line.decode("utf-8-sig" if first else "utf-8").strip()
    except UnicodeDecodeError:
        return None, "not UTF-8"
    if not text:
        return None, None
    try:
        row = json.loads(text)
    except (ValueError, RecursionError):  # (JSONDecodeError, a number of more digits than Python reads)
        return None, "cut off" if not line.endswith(b"\n") else "not JSON"
    if not isinstance(row, dict):
        return None, "not a JSON object"
    return row, None


def _numbers(numbers: list[int], shown: int = 5) -> str:
    return ", ".join(map(str, numbers[:shown])) + (f" and {len(numbers) - shown} more" if len(numbers) > shown else "")


def sample_problem(record: dict) -> str | None:
    """Why a sample episode cannot be shown (its spans or segments are not lists of objects), or None."""
    spans = record.get("spans") or []
    segments = record.get("segments") or []
    if not _objects(spans):
        return "sample episodes whose spans are not a list of objects"
    if not _objects(segments) or not all(_objects(seg.get("spans") or []) for seg in segments):
        return "sample episodes whose segments are not a list of objects with spans"
    return None


def _objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


# -- charts ----------------------------------------------------------------------------------------------------


ATTEMPT_KEY = re.compile(r"(success_by|pass_at)_(\d+)$")


def attempt_keys(run: Run, prefix: str) -> list[str]:
    """``success_by_1``, ``success_by_2``... (or ``pass_at_k``) as logged, in order of k."""
    keys = {k for r in run.rows for k in r if (m := ATTEMPT_KEY.match(k)) and m.group(1) == prefix}
    return sorted(keys, key=lambda k: int(k.rsplit("_", 1)[1]))


def run_charts(run: Run) -> list[str]:
    """One run's charts (those with something logged)."""
    charts = []
    rollouts, evaluation = run.rollout_kind(), run.eval_kind()
    success = [Series(rollouts, run.curve("success"))]
    success += [Series(f"{split}: {evaluation}", run.curve("success", "eval", split), points=True)
                for split in run.splits()]
    charts.append(line_chart(success, title="Success by split", y_label="success", y_range=(0, 1)))
    charts.append(line_chart([Series("train reward", run.curve("reward"))], title="Reward (training rollouts)",
                             y_label="reward"))
    tools = [Series("tool calls / episode", run.curve("tool_calls")),
             Series("tool errors / episode", run.curve("tool_errors"), dashed=True)]
    tools += [Series(f"{split} tool calls ({evaluation})", run.curve("tool_calls", "eval", split), points=True)
              for split in run.splits()]
    charts.append(line_chart(tools, title="Tool calls per episode", y_label="calls"))
    errors = [Series("errored episodes, training rollouts", run.curve("error_rate"))]
    errors += [Series(f"{split} ({evaluation})", run.curve("errored", "eval", split), points=True)
               for split in run.splits()]
    if any(s.xy for s in errors):
        charts.append(line_chart(errors, title="Errored episodes (fraction)", y_label="fraction", y_range=(0, 1)))
    context = [Series("context peak (mean)", run.curve("context_peak_tokens_mean")),
               Series("context peak (max)", run.curve("context_peak_tokens_max"), dashed=True),
               Series("tokens per sequence", _ratio(run, "tokens", "trained_sequences")),
               Series("sampled tokens per episode", run.curve("sampled_tokens"), dashed=True)]
    if any(s.xy for s in context):
        charts.append(line_chart(context[:2] if context[0].xy else context[2:], title="Context length per episode",
                                 y_label="tokens"))
    summaries = [Series(k.replace("_", " "), run.curve(k)) for k in ("summaries_per_episode", "windows_per_episode",
                                                                    "branches_per_episode") if run.curve(k)]
    if any(y for s in summaries for _, y in s.xy):
        charts.append(line_chart(summaries, title="Context rewrites per episode", y_label="per episode"))
    charts += attempt_charts(run)
    for key in POLICY_KEYS:
        if run.curve(key):
            charts.append(line_chart([Series(key, run.curve(key))], title=key.replace("_", " "), y_label=key))
    clip = [Series(k, run.curve(k)) for k in ("clip_frac_low", "clip_frac_high") if run.curve(k)]
    if len(clip) == 2:
        charts = [c for c in charts if "clip frac" not in c[:400]]
        charts.append(line_chart(clip, title="Clip fractions", y_label="fraction"))
    return charts


def attempt_charts(run: Run) -> list[str]:
    """Meta-RL's trials: success by attempt k (a success among attempts 1..k) over steps, and pass@k of independent
    first attempts (its baseline), each in the training rollouts and the held-out evaluations, where logged."""
    charts = []
    split = "heldout" if "heldout" in run.splits() else (run.splits() or [""])[0]
    for prefix, title in (("success_by", "Success by attempt k (a success among attempts 1..k)"),
                          ("pass_at", "pass@k of independent first attempts")):
        keys = attempt_keys(run, prefix)
        series = [Series(f"@{k.rsplit('_', 1)[1]} training", run.curve(k), color=PALETTE[i % len(PALETTE)])
                  for i, k in enumerate(keys)]
        series += [Series(f"@{k.rsplit('_', 1)[1]} {split} eval", run.curve(k, "eval", split), points=True,
                          color=PALETTE[i % len(PALETTE)]) for i, k in enumerate(keys)]
        if any(s.xy for s in series):
            charts.append(line_chart(series, title=title, y_label="success", y_range=(0, 1)))
    return charts


def attempt_table(run: Run) -> str:
    """Success by attempt at each split's last evaluation (``success_by_k``, or the mean over tasks of
    ``task_success_by_attempt``) beside pass@k of independent first attempts; "" when no trials were played."""
    rows = []
    for split in run.splits():
        last = run.evaluations(split)[-1] if run.evaluations(split) else {}
        by = [finite(last.get(k)) for k in attempt_keys(run, "success_by")]
        tasks = last.get("task_success_by_attempt")
        if not any(v is not None for v in by) and isinstance(tasks, dict) and tasks:
            lists = [v for v in tasks.values() if isinstance(v, list) and v]
            width = max((len(v) for v in lists), default=0)
            by = [sum(finite(v[k]) or 0.0 for v in lists if len(v) > k) / len(lists) for k in range(width)]
        passes = [finite(last.get(k)) for k in attempt_keys(run, "pass_at")]
        if any(v is not None for v in by):
            rows.append((split, finite(last.get("step")), by, passes))
    if not rows:
        return ""
    width = max(len(by) for _, _, by, _ in rows)
    passes = max(len(p) for _, _, _, p in rows)
    out = ['<table class="attempts"><tr><th>split (last evaluation)</th>'
           + "".join(f"<th>success by attempt {k + 1}</th>" for k in range(width))
           + "".join(f"<th>pass@{k + 1}, independent</th>" for k in range(passes)) + "</tr>"]
    for split, step, by, ps in rows:
        out.append(f"<tr><td>{escape(split)} (step {_step(step)})</td>"
                   + "".join(f"<td>{_cell(by[k] if k < len(by) else None)}</td>" for k in range(width))
                   + "".join(f"<td>{_cell(ps[k] if k < len(ps) else None)}</td>" for k in range(passes)) + "</tr>")
    out.append("</table>")
    return "<h3>Success by attempt</h3>" + "".join(out)


def _ratio(run: Run, numerator: str, denominator: str) -> list[tuple[float, float]]:
    """(step, numerator / denominator) of the training rows (a step's tokens over its sequences)."""
    out = []
    for r in run.phase("rl"):
        x, a, b = finite(r.get("step")), finite(r.get(numerator)), finite(r.get(denominator))
        if x is not None and a is not None and b:
            out.append((x, a / b))
    return out


def comparison_charts(runs: list[Run]) -> list[str]:
    """The runs' curves overlaid, one colour per run."""
    charts = []
    heldout = []
    for i, run in enumerate(runs):
        color = PALETTE[i % len(PALETTE)]
        heldout.append(Series(f"{run.name} training rollouts", run.curve("success"), color=color))
        split = "heldout" if "heldout" in run.splits() else (run.splits() or [""])[0]
        heldout.append(Series(f"{run.name} {split} ({run.eval_kind()})", run.curve("success", "eval", split),
                              points=True, color=color))
    charts.append(line_chart(heldout, title="Success: training rollouts and held-out evaluations", y_range=(0, 1),
                             y_label="success"))
    for key, title in (("reward", "Reward"), ("tool_calls", "Tool calls per episode"), ("entropy", "Entropy"),
                       ("error_rate", "Errored episodes (fraction)"),
                       ("context_peak_tokens_mean", "Context length per episode")):
        series = [Series(run.name, run.curve(key), color=PALETTE[i % len(PALETTE)]) for i, run in enumerate(runs)]
        if any(s.xy for s in series):
            charts.append(line_chart(series, title=title, y_label=key))
    return charts


def _flat_settings(table: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flat_settings(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_diff(runs: list[Run]) -> str:
    """The settings in which the runs' ``config.toml`` files differ, one row each ("(not set)" where a run's file
    lacks the key, as an older version of ctxrl writes): what makes the compared curves differ, besides the seed."""
    flat = [_flat_settings(run.settings) for run in runs]
    keys = sorted({k for f in flat for k in f})
    missing = object()
    differ = [k for k in keys if len({json.dumps(f.get(k, missing), default=str) for f in flat}) > 1]
    unread = [run.name for run in runs if not run.settings]
    note = (f"<p>no config.toml could be read for {escape(', '.join(unread))}</p>" if unread else "")
    if not differ:
        return "<h3>Settings that differ</h3>" + note + "<p>none: every config.toml holds the same settings</p>"
    out = ['<table class="config-diff"><tr><th>setting</th>'
           + "".join(f"<th>{escape(run.name)}</th>" for run in runs) + "</tr>"]
    for key in differ:
        cells = "".join(f"<td>{escape(json.dumps(f[key], default=str)) if key in f else '(not set)'}</td>"
                        for f in flat)
        out.append(f"<tr><td>{escape(key)}</td>{cells}</tr>")
    out.append("</table>")
    return "<h3>Settings that differ</h3>" + note + "".join(out)


# -- episodes ---------------------------------------------------------------------------------------------------

ROLE_MARKERS = re.compile(r"<\|im_start\|>(\w+)|<\|start_header_id\|>(\w+)<\|end_header_id\|>"
                          r"|\[INST\]|<start_of_turn>(\w+)")


def messages_of(spans: list[dict]) -> list[dict]:
    """Cut a sequence's mask spans into messages at the chat template's role markers, for display only.

    Every character stays, in order, with its span's mask; a template this does not know gives one message.
    Returns ``[{"role": str, "pieces": [(text, mask), ...]}]``.
    """
    text = "".join(str(s.get("text", "")) for s in spans)
    cuts = [(m.start(), next((g for g in m.groups() if g), "user")) for m in ROLE_MARKERS.finditer(text)]
    if not cuts or cuts[0][0] != 0:
        cuts.insert(0, (0, "text"))
    messages = [{"role": role, "pieces": [], "start": start} for start, role in cuts]
    pos, k = 0, 0
    for span in spans:
        piece, mask = str(span.get("text", "")), 1 if finite(span.get("mask")) else 0
        while piece:
            while k + 1 < len(messages) and messages[k + 1]["start"] <= pos:
                k += 1
            end = messages[k + 1]["start"] if k + 1 < len(messages) else pos + len(piece)
            take = max(1, min(len(piece), end - pos))
            messages[k]["pieces"].append((piece[:take], mask))
            piece, pos = piece[take:], pos + take
    return [{"role": m["role"], "pieces": m["pieces"]} for m in messages if m["pieces"]]


def _message_kind(message: dict) -> str:
    text = "".join(t for t, _ in message["pieces"])
    if message["role"] in ("tool", "ipython") or "<tool_response>" in text:
        return "tool result"
    if "<tool_call>" in text or '"name":' in text and any(m for _, m in message["pieces"]):
        return "tool call" if message["role"] == "assistant" else message["role"]
    return message["role"]


def render_sequence(spans: list[dict]) -> str:
    """A sequence as a conversation: one block per message, each span marked by its loss mask."""
    out = ['<div class="conversation">']
    for message in messages_of(spans):
        kind = _message_kind(message)
        out.append(f'<div class="msg role-{escape(kind.replace(" ", "-"))}"><div class="role">{escape(kind)}</div>'
                   '<pre class="text">')
        for text, mask in message["pieces"]:
            bit = 1 if mask else 0
            out.append(f'<span class="mask{bit}" title="loss mask {bit}">{escape(text)}</span>')
        out.append("</pre></div>")
    out.append("</div>")
    return "".join(out)


def render_episode(record: dict, *, open_: bool = False) -> str:
    """One sample episode: its figures, then each earlier sequence (a rewritten context), then the live one."""
    ok = record.get("success")
    head = (f'{escape(str(record.get("phase", "")))} · step {escape(str(record.get("step", "")))} · '
            f'{escape(str(record.get("split", "")))} · {escape(str(record.get("task_id", "")))} · '
            f'reward {escape(str(record.get("reward", "")))} · {"success" if ok else "failure"} · '
            f'{escape(str(record.get("tool_calls", 0)))} tool calls · {escape(str(record.get("tokens", "")))} tokens '
            f'({escape(str(record.get("sampled_tokens", "")))} sampled)')
    out = [f'<details class="episode {"ok" if ok else "fail"}"{" open" if open_ else ""}><summary>{head}</summary>',
           f'<p class="task"><b>task</b> {escape(str(record.get("prompt", "")))} <b>answer</b> '
           f'{escape(str(record.get("answer", "")))}</p>']
    if record.get("error"):
        out.append(f'<p class="error">error ({escape(str(record.get("error_kind")))}): '
                   f'{escape(str(record["error"]))}</p>')
    segments = record.get("segments") or []
    for i, segment in enumerate(segments):
        ended = str(segment.get("ended_by", ""))
        meaning = SEGMENT_MEANING.get(ended, "")
        out.append(f'<div class="segment ended-{escape(ended)}"><div class="segment-head">sequence {i + 1} of '
                   f'{len(segments) + 1}: ended by <b>{escape(ended)}</b>{" — " + escape(meaning) if meaning else ""}'
                   f' ({escape(str(segment.get("tokens", "")))} tokens)</div>')
        out.append(render_sequence(segment.get("spans") or []))
        out.append("</div>")
    if segments:
        out.append(f'<div class="segment-head">sequence {len(segments) + 1} of {len(segments) + 1}: the last</div>')
    out.append(render_sequence(record.get("spans") or []))
    out.append("</details>")
    return "".join(out)


def chosen_samples(run: Run) -> list[dict]:
    """The episodes shown: per phase, ``EPISODES_PER_PHASE`` of its last logged step; and the last episode with a
    rewritten context (earlier sequences) if none of those has one."""
    last: dict[str, int] = {}
    for s in run.samples:
        step = finite(s.get("step"))
        if step is not None:
            last[str(s.get("phase"))] = max(last.get(str(s.get("phase")), -1), int(step))
    shown: dict[str, list[dict]] = {}
    for s in run.samples:
        phase = str(s.get("phase"))
        if s.get("step") == last.get(phase) and len(shown.setdefault(phase, [])) < EPISODES_PER_PHASE:
            shown[phase].append(s)
    order = {"sft": 0, "rl": 2}
    chosen = [s for phase in sorted(shown, key=lambda p: (order.get(p, 1), p)) for s in shown[phase]]
    rewritten = [s for s in run.samples if s.get("segments")]
    if rewritten and not any(s.get("segments") for s in chosen):  # a summary (fold, attempt...) is worth showing
        chosen.append(rewritten[-1])
    return chosen


# -- the page ---------------------------------------------------------------------------------------------------

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1500px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;margin-top:1.6em}
.charts{display:flex;flex-wrap:wrap;gap:12px}
.chart{background:#fff;border:1px solid #ddd}.chart-title{font-weight:600;font-size:13px}
.plot-area{fill:#fcfcfc;stroke:#bbb}.grid{stroke:#e4e4e4}.tick,.legend,.axis{font-size:11px;fill:#444}
.empty{fill:#999}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}
.legend-mask span{padding:1px 6px;margin-right:8px}
.episode{border:1px solid #ccc;margin:8px 0;padding:4px 8px}.episode.ok>summary{color:#176317}
.episode.fail>summary{color:#a11}summary{cursor:pointer;font-weight:600}
.conversation{margin:6px 0 10px 0}
.msg{border-left:4px solid #bbb;margin:4px 0;padding:2px 8px;background:#fafafa}
.msg.role-assistant,.msg.role-tool-call{border-color:#3a8f3a}.msg.role-tool-result{border-color:#d08a00}
.msg.role-system{border-color:#888}.role{font-size:11px;text-transform:uppercase;color:#666}
pre.text{white-space:pre-wrap;word-break:break-word;margin:2px 0;font:12px/1.4 ui-monospace,monospace}
.mask1{background:#b7e4b0}.mask0{background:#ececec;color:#555}
.segment{border:1px dashed #aaa;padding:4px;margin:6px 0}.segment-head{font-size:12px;color:#444;margin:6px 0 2px}
.error{color:#a11}details.config pre{background:#f6f6f6;padding:8px;font-size:12px}
.flat-note{font-size:10px;fill:#888}.note{color:#555;font-size:12px}
.series.smoothed{display:none}#smooth:checked~* .series.smoothed{display:inline}
#smooth:checked~* .series.raw{opacity:.2}.toggle{font-size:13px}
"""

SMOOTH_TOGGLE = ('<input type="checkbox" id="smooth"><label for="smooth" class="toggle"> smooth the training curves '
                 f'(exponential moving average, weight {EMA_WEIGHT}; the raw curve stays, faint)</label>')
"""A checkbox that shows each training curve's EMA instead of its raw values, by CSS alone (the page has no script):
it must precede, as a sibling, every element that holds a chart."""

MASK_LEGEND = ('<p class="legend-mask"><span class="mask1">loss mask 1: sampled by the policy (trained)</span>'
               '<span class="mask0">loss mask 0: given (prompt, template, tool results, environment text)</span></p>')


def _cell(value) -> str:
    value = finite(value)
    if value is None:
        return "-"
    return f"{value:.0f}" if value.is_integer() and abs(value) > 1 else f"{value:.3f}"


def _step(value) -> str:
    value = finite(value)
    return "-" if value is None else f"{value:g}"


def final_table(runs: list[Run]) -> str:
    finals = [run.final() for run in runs]
    keys = list(dict.fromkeys(k for f in finals for k in f))
    out = ['<table class="final"><tr><th>run</th>' + "".join(f"<th>{escape(k)}</th>" for k in keys) + "</tr>"]
    for run, f in zip(runs, finals):
        out.append(f"<tr><td>{escape(run.name)}</td>" + "".join(f"<td>{_cell(f.get(k))}</td>" for k in keys) + "</tr>")
    out.append("</table>")
    return "".join(out)


def evaluation_table(run: Run) -> str:
    """Each split's first and last evaluation, and their change: the before/after table ``ctxrl train`` prints
    (tool calls from ``heldout``, or ``train`` without one), with the steps they were taken at."""
    rows, first_step, last_step = [], None, None
    for split in run.splits():
        evals = run.evaluations(split)
        before, after = (evals[0], evals[-1]) if evals else ({}, {})
        b, a = finite(before.get("success")), finite(after.get("success"))
        first_step, last_step = finite(before.get("step")), finite(after.get("step"))
        rows.append((split, b, a, None if a is None or b is None else a - b))
    if not rows:
        return "<p>no evaluation logged yet</p>"
    source = "heldout" if "heldout" in run.splits() else "train"
    evals = run.evaluations(source)
    before_label = "after warm start" if run.phase("sft") else "before RL"
    out = [f'<table class="evaluation"><caption>success per split, {escape(run.eval_kind())} '
           f"(the table <code>ctxrl train</code> prints)</caption><tr><th>split</th>"
           f"<th>{before_label} (step {_step(first_step)})</th><th>last (step {_step(last_step)})</th>"
           "<th>change</th></tr>"]
    for split, b, a, change in rows:
        out.append(f"<tr><td>{escape(split)}</td><td>{_cell(b)}</td><td>{_cell(a)}</td>"
                   f"<td>{'-' if change is None else f'{change:+.3f}'}</td></tr>")
    if evals:
        out.append(f"<tr><td>tool calls / episode ({source})</td><td>{_cell(evals[0].get('tool_calls'))}</td>"
                   f"<td>{_cell(evals[-1].get('tool_calls'))}</td><td></td></tr>")
    out.append("</table>")
    return "".join(out)


ROLLOUT_KEYS = ("success", "reward", "tool_calls", "error_rate", "entropy")


def rollout_table(run: Run, last: int = 5) -> str:
    """The training rollouts' figures: the last step's, and the mean of the last ``last`` steps (one step's sample
    of a few tasks is noisy)."""
    rl = [r for r in run.phase("rl") if finite(r.get("step")) is not None]
    if not rl:
        return ""
    tail = rl[-last:]

    def mean(key: str) -> float | None:
        values = [v for v in (finite(r.get(key)) for r in tail) if v is not None]
        return sum(values) / len(values) if values else None

    keys = [k for k in ROLLOUT_KEYS if any(finite(r.get(k)) is not None for r in tail)]
    out = [f'<table class="rollouts"><caption>{escape(run.rollout_kind())}: the episodes RL trained on, not an '
           "evaluation</caption><tr><th></th>" + "".join(f"<th>{escape(k.replace('_', ' '))}</th>" for k in keys)
           + "</tr>",
           f"<tr><td>last step ({_step(rl[-1].get('step'))})</td>"
           + "".join(f"<td>{_cell(rl[-1].get(k))}</td>" for k in keys) + "</tr>",
           f"<tr><td>mean of the last {len(tail)} step{'s' if len(tail) > 1 else ''}</td>"
           + "".join(f"<td>{_cell(mean(k))}</td>" for k in keys)
           + "</tr></table>"]
    return "".join(out)


def run_summary(run: Run) -> str:
    return ("<h3>Final figures</h3>" + evaluation_table(run) + rollout_table(run)
            + '<p class="note">The evaluations decode greedily on fixed tasks of each split (unless eval.temperature '
              "is set); the training rollouts sample at rollout.temperature on a step's few tasks, so their success "
              "differs from the evaluations' and moves more from step to step: the evaluations are the run's "
              "result. Both are in metrics.jsonl: rows of phase \"eval\" and \"rl\".</p>"
            + attempt_table(run))


def run_section(run: Run, *, summary: bool = False) -> str:
    """A run's charts, sample episodes and config; ``summary``: its final figures first (a compared run's)."""
    out = [f'<section class="run" id="run-{escape(run.name)}"><h2>{escape(run.name)}</h2>',
           f'<p class="run-dir">{escape(str(run.dir))}</p>', run_summary(run) if summary else "",
           '<div class="charts">' + "".join(run_charts(run)) + "</div>",
           "<h3>Sample episodes</h3>", MASK_LEGEND]
    samples = chosen_samples(run)
    out.extend(render_episode(s, open_=i == 0) for i, s in enumerate(samples))
    if not samples:
        out.append("<p>no samples logged yet</p>")
    if run.config:
        out.append(f'<details class="config"><summary>config.toml</summary><pre>{escape(run.config)}</pre></details>')
    if run.skipped:
        out.append('<div class="skipped"><h3>Skipped (damaged files)</h3><ul>'
                   + "".join(f"<li>{escape(line)}</li>" for line in run.skipped) + "</ul></div>")
    out.append("</section>")
    return "".join(out)


def render(run_dirs: list[str | Path], runs: list[Run] | None = None) -> str:
    """The page (a string) for one run directory, or a comparison of several (``runs``: read already)."""
    runs = runs if runs is not None else [Run(d) for d in run_dirs]
    title = "ctxrl run " + runs[0].name if len(runs) == 1 else "ctxrl runs: " + ", ".join(r.name for r in runs)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{escape(title)}</title><style>{CSS}</style></head><body>", f"<h1>{escape(title)}</h1>"]
    if len(runs) > 1:
        out.append(SMOOTH_TOGGLE)
        out.append('<section class="comparison"><h2>Comparison</h2><div class="charts">'
                   + "".join(comparison_charts(runs)) + "</div><h3>Final figures</h3>" + final_table(runs)
                   + config_diff(runs) + "</section>")
    else:
        out.append(f'<section class="summary">{run_summary(runs[0])}</section>')
        out.append(SMOOTH_TOGGLE)
    out.extend(run_section(run, summary=len(runs) > 1) for run in runs)
    out.append("</body></html>")
    return "\n".join(out)


def write_report(run_dirs: list[str | Path] | str | Path, out: str | Path | None = None) -> Path:
    """Write the page to ``out`` (default: the first run's ``report.html``), through a temporary file; say on stderr
    what was skipped (``Run.skipped``). A ``CtxrlError`` when ``out`` is a folder or in none."""
    dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    path = Path(out) if out is not None else Path(dirs[0]) / "report.html"
    if path.is_dir():
        raise CtxrlError(f"--out {path} is a folder; give the page's file name, such as {path / 'report.html'}")
    if not path.parent.is_dir():
        raise CtxrlError(f"--out {path}: there is no folder {path.parent}; create it, or write the page elsewhere")
    runs = [Run(d) for d in dirs]
    for run in runs:
        for line in run.skipped:
            print(f"ctxrl report: {run.dir}/{line}", file=sys.stderr)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(dirs, runs), encoding="utf-8")
    tmp.replace(path)  # a reader (a browser reloading it mid-run) never sees half a page
    return path
