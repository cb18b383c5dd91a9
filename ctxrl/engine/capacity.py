"""The fast engine's cache sizes and the check that its cache fits, readable without loading the engine.

``FastEngine`` (``ctxrl.engine.fast``) takes its defaults and its per-slot cache length from here,
and so does a run's memory plan (``ctxrl.learner.memory``, ``ctxrl.learner.sizing``), which sizes the
engine before one is built: importing the engine itself would load Triton. The engine factory
(``ctxrl.engine.factory``), which chooses and builds an engine, sits above both.
"""

from __future__ import annotations

import gc

import torch

DECODE_CHUNK = 8
"""Decode steps the fast engine queues per visit of the host (``FastEngine(decode_chunk=...)``'s default)."""
PREFILL_TOKENS = 16384
"""New tokens the fast engine prefills together at most (its default; a memory plan may set fewer:
``ctxrl.learner.memory``)."""


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
