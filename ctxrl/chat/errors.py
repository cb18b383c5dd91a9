"""The chat templates' errors, below every module of ``ctxrl.chat`` that raises or catches them.

``ctxrl.chat.render`` re-exports both (``from ctxrl.chat.render import TemplateError`` is how callers
import them); they live here so that the start-up checks (``ctxrl.chat.checks``), which the renderer
calls, can raise and catch them without importing the renderer.
"""

from __future__ import annotations

from ctxrl.errors import CtxrlError


class TemplateError(CtxrlError, RuntimeError):
    """The chat template cannot be rendered incrementally."""

    kind = "chat template error"


class HistoryRewritten(TemplateError):
    """The template rendered earlier messages differently once a new user message followed them.

    Not a failure: the episode's ``Recorder`` starts a new segment from a fresh rendering.
    """
