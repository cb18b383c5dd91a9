"""Which engine serves a run: ``rollout.engine`` = ``hf``, ``fast`` or ``auto``."""

from __future__ import annotations

import gc
import logging

import torch

from ctxrl.engine.base import Engine

KINDS = ("auto", "hf", "fast")
DECODE_CHUNK = 8
"""Decode steps the fast engine queues per visit of the host (``FastEngine(decode_chunk=...)``'s default)."""
PREFILL_TOKENS = 16384
"""New tokens the fast engine prefills together at most (its default; a memory plan may set fewer:
``ctxrl.train.memory``)."""
log = logging.getLogger(__name__)


def make_engine(model, *, kind: str, pad_token_id: int, max_batch_size: int, seed: int, max_total_tokens: int,
                decode=None, prefill_tokens: int | None = None) -> Engine:
    """An engine serving ``model``: ``auto`` is the fast engine on CUDA where it can run the model, else HF.

    ``prefill_tokens``: the fast engine's largest prefill (None: its default); a memory plan sets it
    (``ctxrl.train.memory``). The HF engine has no such setting."""
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


def slot_capacity(max_total_tokens: int, decode_chunk: int = DECODE_CHUNK) -> int:
    """Cache positions per slot of the fast engine: ``max_total_tokens``, and room for the steps a row runs past
    its end (the rest of its decode chunk and the next one, queued before the host has read where it ended)."""
    return max_total_tokens + 2 * decode_chunk + 1


def cache_fits(nbytes: int, device: torch.device) -> str | None:
    """Why a KV cache of ``nbytes`` does not fit on ``device`` now (``None``: it does).

    Memory this process freed stays in torch's allocator cache, which the device's free figure does not
    count: a run that builds a second engine (an evaluation after training) would be refused room it
    holds itself. So before refusing, collect garbage, hand the cache back and ask again."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > 0.9 * free:
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
    if nbytes > 0.9 * free:
        return f"{nbytes / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free"
    return None
