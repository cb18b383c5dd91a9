"""``full``: the whole history, always (the baseline; ``rollout.max_total_tokens`` still caps an episode)."""

from __future__ import annotations

from ctxrl.rollout.managers.base import ContextManager, register_manager


@register_manager
class Full(ContextManager):
    """Every turn and observation stays in the context; nothing is rewritten."""

    name = "full"
