"""Which engine serves a run: ``rollout.engine`` = ``hf``, ``fast`` or ``auto``."""

from __future__ import annotations

import logging

from ctxrl.engine.base import Engine

KINDS = ("auto", "hf", "fast")
log = logging.getLogger(__name__)


def make_engine(model, *, kind: str, pad_token_id: int, max_batch_size: int, seed: int, max_total_tokens: int,
                decode=None, prefill_tokens: int | None = None) -> Engine:
    """An engine serving ``model``: ``auto`` is the fast engine on CUDA where it can run the model, else HF.

    ``prefill_tokens``: the fast engine's largest prefill (None: its default); a memory plan sets it
    (``ctxrl.learner.memory``). The HF engine has no such setting."""
    from ctxrl.engine.hf import HFEngine

    if kind not in KINDS:
        raise ValueError(f"rollout.engine must be one of {', '.join(KINDS)}, got {kind!r}")
    device = next(model.parameters()).device
    if kind == "auto":
        from ctxrl.engine.fast import unsupported_reason

        reason = "it runs on CUDA only by default" if device.type != "cuda" else unsupported_reason(
            model, max_total_tokens)
        kind = "hf" if reason else "fast"
        if reason and device.type == "cuda":
            log.warning("rollout.engine = auto: using the HF engine, not the fast one: %s", reason)
    if kind == "hf":
        return HFEngine(model, pad_token_id=pad_token_id, max_batch_size=max_batch_size, seed=seed, decode=decode)
    from ctxrl.engine.fast import FastEngine

    sizes = {} if prefill_tokens is None else {"prefill_tokens": prefill_tokens}
    return FastEngine(model, pad_token_id=pad_token_id, max_batch_size=max_batch_size, seed=seed,
                      max_total_tokens=max_total_tokens, decode=decode, **sizes)
