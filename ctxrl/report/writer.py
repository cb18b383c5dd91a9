"""The run directory: resolved config, append-only metrics and samples, plots, checkpoints.

``metrics.jsonl`` and ``samples.jsonl`` are opened in append mode and flushed after every line,
so a crash loses at most the line being written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ctxrl.types import Episode


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class LogRewindError(RuntimeError):
    """A log is shorter than a checkpoint says it was: it was truncated or replaced since."""


class RunWriter:
    """The run directory's logs; every row and sample also goes to the run's ``sinks`` (``ctxrl.report.sinks``)."""

    def __init__(self, run_dir: str | Path, *, sinks: list | None = None,
                 folders: tuple[str, ...] = ("checkpoints", "plots")) -> None:
        """``folders``: made now, for what a training run writes there (an evaluation writes none: no empty
        folders in its directory)."""
        self.dir = Path(run_dir)
        self.sinks = list(sinks or [])
        self.dir.mkdir(parents=True, exist_ok=True)
        for folder in folders:
            (self.dir / folder).mkdir(exist_ok=True)
        self._metrics = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")
        self._samples = open(self.dir / "samples.jsonl", "a", encoding="utf-8")

    def write_config(self, toml_text: str) -> None:
        (self.dir / "config.toml").write_text(toml_text)

    def log_metrics(self, row: dict[str, Any]) -> None:
        self._append(self._metrics, [json.dumps({k: _clean(v) for k, v in row.items()})])
        for sink in self.sinks:
            sink.log_metrics(row)

    def log_samples(self, step: int, episodes: list[Episode], decode, *, phase: str = "train") -> None:
        records = [episode_record(ep, decode, step=step, phase=phase) for ep in episodes]
        self._append(self._samples, [json.dumps(record) for record in records])
        for sink in self.sinks:
            sink.log_samples(records)

    @staticmethod
    def _append(handle, lines: list[str]) -> None:
        """``lines`` at the end of the log ``handle``, flushed; a failed write (a full disk) names the file."""
        try:
            for line in lines:
                handle.write(line + "\n")
            handle.flush()
        except OSError as exc:
            if exc.filename is not None or exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror, handle.name) from exc

    def offsets(self) -> dict[str, int]:
        """Byte length of each log now (everything flushed): where a checkpoint's logs end."""
        out = {}
        for name, handle in (("metrics.jsonl", self._metrics), ("samples.jsonl", self._samples)):
            handle.flush()
            os.fsync(handle.fileno())  # a checkpoint must never count bytes an OS crash could take back
            out[name] = os.fstat(handle.fileno()).st_size  # not tell(): wrong after a rewind
        return out

    def rewind(self, offsets: dict[str, int], step: int | None = None) -> dict[str, int]:
        """Cut each log back to ``offsets`` (a checkpoint's); the cut lines go to ``NAME.orphaned.jsonl``.

        Nothing is lost: lines written after the checkpoint (by steps the resumed run will redo)
        are appended to the orphan file, so ``metrics.jsonl`` holds every step exactly once.
        Returns the number of bytes moved per log.
        """
        moved = {}
        for name, handle in (("metrics.jsonl", self._metrics), ("samples.jsonl", self._samples)):
            handle.flush()
            path = self.dir / name
            keep = int(offsets.get(name, 0))
            size = path.stat().st_size
            if size < keep:
                raise LogRewindError(f"{path} is {size} bytes, shorter than the checkpoint's {keep}: the log was "
                                 "truncated or replaced since the checkpoint; restore it before resuming")
            if size > keep:
                with open(path, "rb") as f:
                    f.seek(keep)
                    tail = f.read()
                if not tail.endswith(b"\n"):  # a line cut by the kill: keep it, on a line of its own
                    tail += b"\n"
                with open(self.dir / name.replace(".jsonl", ".orphaned.jsonl"), "ab") as f:
                    f.write(tail)
                    f.flush()
                    os.fsync(f.fileno())
                os.truncate(path, keep)
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            moved[name] = size - keep
        if step is not None:
            for sink in self.sinks:
                sink.rewind(step)
        return moved

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
        for sink in self.sinks:
            sink.close()


def mask_spans(episode: Episode) -> list[tuple[int, int, int]]:
    """(start, end, mask) runs of equal loss mask over the episode's ids."""
    spans = []
    start = 0
    mask = episode.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            spans.append((start, i, mask[start]))
            start = i
    return spans


def episode_record(episode: Episode, decode, *, step: int, phase: str) -> dict[str, Any]:
    """A decoded episode with its mask visible: spans of text marked trained (1) or context (0)."""
    return {
        "step": step,
        "phase": phase,
        "task_id": episode.task.id,
        "split": episode.task.split,
        "prompt": episode.task.prompt,
        "answer": episode.task.answer,
        "reward": episode.reward,
        "success": episode.success,
        "truncation": episode.truncation,
        "tool_calls": episode.tool_calls,
        "tool_errors": episode.tool_errors,
        "tokens": len(episode.input_ids),
        "sampled_tokens": episode.num_sampled_tokens,
        "policy_version": episode.policy_version,
        "error": episode.info.get("error"),
        "error_kind": episode.info.get("error_kind"),
        "spans": [{"mask": m, "text": decode(episode.input_ids[a:b])} for a, b, m in mask_spans(episode)],
        # earlier sequences of an episode whose context was rewritten (summaries, windows, fold branches)
        "segments": [{"ended_by": s.ended_by, "tokens": len(s.input_ids),
                      "spans": [{"mask": m, "text": decode(s.input_ids[a:b])} for a, b, m in mask_spans(s)]}
                     for s in episode.segments],
    }
