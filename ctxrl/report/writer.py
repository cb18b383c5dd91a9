"""The run directory: resolved config, append-only metrics and samples, plots, checkpoints.

``metrics.jsonl`` and ``samples.jsonl`` are opened in append mode and flushed after every line,
so a crash loses at most the line being written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ctxrl.types import Episode


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class RunWriter:
    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "checkpoints").mkdir(exist_ok=True)
        (self.dir / "plots").mkdir(exist_ok=True)
        self._metrics = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")
        self._samples = open(self.dir / "samples.jsonl", "a", encoding="utf-8")

    def write_config(self, toml_text: str) -> None:
        (self.dir / "config.toml").write_text(toml_text)

    def log_metrics(self, row: dict[str, Any]) -> None:
        self._metrics.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._metrics.flush()

    def log_samples(self, step: int, episodes: list[Episode], decode, *, phase: str = "train") -> None:
        for ep in episodes:
            self._samples.write(json.dumps(episode_record(ep, decode, step=step, phase=phase)) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()


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
        "spans": [{"mask": m, "text": decode(episode.input_ids[a:b])} for a, b, m in mask_spans(episode)],
    }
