"""Errors that describe a user's mistake: each message names what is wrong and how to fix it.

The command line prints these as one line (no traceback) and exits 2. Anything else that
escapes is a ctxrl bug or a system failure, and keeps its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the key and how to fix it."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the run."""
