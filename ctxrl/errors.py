"""Errors that describe a user's mistake: each message names what is wrong and how to fix it.

Every such error is a ``CtxrlError``. The command line prints one as a single line (no traceback;
``--debug`` or ``CTXRL_DEBUG=1`` shows it) and exits 2. Anything else that escapes is a ctxrl bug
or a system failure, and keeps its traceback. The errors of one area live with it (``EnvError``
in ``ctxrl.envs.base``, ``ModelLoadError`` in ``ctxrl.models.loader``, ``TemplateError`` in
``ctxrl.chat.errors``, ``SandboxError`` in ``ctxrl.tools.sandbox``); they all derive from this one.
"""

from __future__ import annotations


class CtxrlError(Exception):
    """A problem the user can fix: bad input, a missing file, a model or template that does not fit."""

    kind = "error"
    """How the command line introduces it (``config error: ...``)."""


class ConfigError(CtxrlError, ValueError):
    """A configuration problem; the message names the key and how to fix it."""

    kind = "config error"


class CheckpointError(CtxrlError, RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the run."""

    kind = "checkpoint error"


class StorageError(CtxrlError, OSError):
    """A file of the run cannot be written (a read-only or full file system, no permission); the message names the
    path and how the run goes on once it can (``ctxrl.run.loop.storage_error``). Still an ``OSError``."""

    kind = "storage error"
