"""Sampling maths for the engine: top-k / top-p filtering and batch-independent random draws.

Why counter-based draws: episodes reach the engine in an order that depends on thread timing
(a tool call that finishes a little sooner lets its episode join an earlier batch). With one
shared ``torch.Generator``, which random numbers a request gets would depend on who else is in
its batch, and a seeded run would not repeat. Here the uniform number for token ``t`` of a
request is a pure function of ``(request seed, t)``: a request samples the same tokens alone
or in any batch, in any order. Sampling is by inverse CDF (one uniform per row and step), which
draws exactly from the filtered distribution.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2**32.

    Both multipliers are below 2**31, so no product overflows int64 on any device.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One float64 in (0, 1) per seed, a pure function of (seed, step); 53 random bits each.

    ``step`` is one token index for every row, or a tensor of each row's own (continuous batching,
    where rows are at different tokens of their completions)."""
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    steps = torch.full_like(seeds, step & MASK32) if isinstance(step, int) else (step.to(seeds) & MASK32)
    h = mix32(mix32(mix32(steps) ^ hi) ^ lo)
    h2 = mix32(h ^ 0x5BD1E995)
    bits = (h << 21) | (h2 >> 11)  # 32 + 21 = 53 bits
    return (bits.double() + 0.5) / float(1 << 53)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index ``i`` per row with ``cdf[i-1] <= u * total < cdf[i]``; never a zero-probability index."""
    cdf = probs.double().cumsum(-1)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    choice = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    # u * total can round up to total itself; fall back to the most likely token then.
    zero = probs.gather(-1, choice.unsqueeze(-1)).squeeze(-1) <= 0
    return torch.where(zero, probs.argmax(-1), choice)


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k, then outside the nucleus (top-p) of what top-k kept.

    The order HF and vLLM use: top-p measures mass in the distribution renormalised over the
    top-k tokens, not in the full one. Rows with k=0, p=1 are untouched.
    """
    if all(k <= 0 for k in top_k) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    k = torch.tensor([k if k > 0 else logits.shape[-1] for k in top_k], device=logits.device).unsqueeze(-1)
    remove = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Drop a token once the mass *before* it already reaches top_p (the top token always stays).
    remove |= (probs.cumsum(-1) - probs) >= top_p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def draw(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
         step: int | torch.Tensor, top_k: list[int] | None = None,
         top_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour log-prob, from float32 ``logits`` ``[rows, vocab]``.

    ``temperature`` ``[rows, 1]``; ``greedy`` ``[rows]`` (argmax, reporting the untruncated T=1
    log-prob); ``seeds`` and ``step`` give each row's uniform draw (``uniforms``). Without
    ``top_k``/``top_p`` nothing syncs with the host, so a CUDA graph can hold it.
    """
    scaled = logits / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if top_k is not None and top_p is not None:
        filtered = filter_logits(scaled, top_k, top_p)
        if filtered is not scaled:
            logprobs = torch.where(greedy.unsqueeze(-1), logprobs, torch.log_softmax(filtered, dim=-1))
    choice = sample_inverse_cdf(logprobs.exp(), uniforms(seeds, step))
    choice = torch.where(greedy, scaled.argmax(-1), choice)
    return choice, logprobs.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
