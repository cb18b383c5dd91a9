"""Where ctxrl keeps what it builds or converts once: ``$CTXRL_CACHE`` (default ``~/.cache/ctxrl``), and the
hashes of large files it has read, remembered there."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("CTXRL_CACHE", Path.home() / ".cache" / "ctxrl")).expanduser()


def file_sha256(path: Path) -> str:
    """The file's SHA-256, remembered per (path, size, mtime) so that a multi-GB file is hashed once."""
    memo = _hash_memo(path)
    if memo.exists():
        value = memo.read_text().strip()
        if len(value) == 64:
            return value
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return remember_sha256(path, digest.hexdigest())


def remember_sha256(path: Path, value: str) -> str:
    """Record ``value`` as the hash of ``path`` as it is now (a writer that hashed while writing), for
    ``file_sha256``."""
    memo = _hash_memo(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.tmp-{os.getpid()}")
    tmp.write_text(value)
    os.replace(tmp, memo)
    return value


def _hash_memo(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "gguf" / "hashes" / key
