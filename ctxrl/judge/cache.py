"""Judge results kept by the hash of what was asked, so that asking again costs nothing.

The key is the SHA-256 of everything that decides a judge's reply: which judge (its endpoint or model name, the
model name sent), the rubric, the conversation it is shown (the task, the episode's transcript or answer, the
reference if shown) and its token budget. A rerun of a seeded run, or a group whose episodes wrote the same answer,
is judged once. Results live in memory and in ``DIR/judge.jsonl`` (one JSON line each, appended with a single
write, so processes sharing a directory do not interleave lines); a line cut short by a killed process is skipped
when the file is read. The default directory is ``$CTXRL_CACHE/judge``.

What it does not know: a judge whose weights changed under the same name (a checkpoint directory trained again)
keeps the old answers. Point ``reward.judge.cache`` elsewhere, or delete the file, after changing a judge in place.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ctxrl.models.cache import cache_root

FILE = "judge.jsonl"


def cache_key(*parts: Any) -> str:
    """The SHA-256 of ``parts`` as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def default_directory() -> Path:
    return cache_root() / "judge"


class JudgeCache:
    """Results by key, in memory and (``directory`` given) on disk; ``directory=None`` keeps nothing across runs."""

    def __init__(self, directory: str | Path | None) -> None:
        self.path = None if directory is None else Path(directory).expanduser() / FILE
        self.entries: dict[str, dict[str, Any]] = {}
        self.skipped_lines = 0
        if self.path is not None and self.path.exists():
            self._read()

    def _read(self) -> None:
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
                self.entries[record["key"]] = record
            except (ValueError, KeyError, TypeError):
                self.skipped_lines += 1  # (a line a killed process left half written)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, record: dict[str, Any]) -> None:
        record = {**record, "key": key}
        self.entries[key] = record
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def __len__(self) -> int:
        return len(self.entries)
