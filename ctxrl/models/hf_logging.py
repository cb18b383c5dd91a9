"""transformers' own output while ctxrl loads or converts a model."""

from __future__ import annotations


def quiet_transformers() -> None:
    """ctxrl draws its own progress bars; silence transformers' per-file ones."""
    from transformers.utils import logging

    logging.disable_progress_bar()
