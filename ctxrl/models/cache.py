"""Where ctxrl keeps what it builds or converts once: ``$CTXRL_CACHE`` (default ``~/.cache/ctxrl``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("CTXRL_CACHE", Path.home() / ".cache" / "ctxrl")).expanduser()
