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

import functools

import torch
import torch.nn.functional as F

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


SAMPLE_BLOCK = 1024
"""Vocabulary entries per block of the two-level inverse CDF (``sample_blocked``)."""


def sample_blocked(weights: torch.Tensor, u: torch.Tensor, block: int = SAMPLE_BLOCK,
                   with_total: bool = False):
    """``sample_inverse_cdf`` over unnormalised ``weights`` in two levels, without a full-vocabulary scan.

    Block sums (float64) locate the block holding ``u * total``; the cumulative sum runs only
    inside that block. Same draw as the one-level form up to float64 rounding at block edges;
    no host sync, so a CUDA graph can hold it. ``with_total``: also return each row's total weight
    (float64), which the block sums give for free.
    """
    rows, vocab = weights.shape
    full = vocab // block * block
    sums = weights[:, :full].reshape(rows, -1, block).sum(-1, dtype=torch.float64)
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], dim=-1)
    cdf = sums.cumsum(-1)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    which = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)  # [rows, 1]
    before = torch.where(which > 0, cdf.gather(-1, (which - 1).clamp(min=0)), torch.zeros_like(target))
    index = which * block + torch.arange(block, device=weights.device)
    inside = weights.gather(-1, index.clamp(max=vocab - 1)) * (index < vocab)
    offset = torch.searchsorted(inside.double().cumsum(-1) + before, target, right=True).clamp(max=block - 1)
    choice = (which * block + offset).squeeze(-1).clamp(max=vocab - 1)
    # u * total can round up to total itself; fall back to the heaviest token then.
    zero = weights.gather(-1, choice.unsqueeze(-1)).squeeze(-1) <= 0
    choice = torch.where(zero, weights.argmax(-1), choice)
    return (choice, cdf[:, -1]) if with_total else choice


def row_stats(logits: torch.Tensor, temperature: torch.Tensor,
              block: int = SAMPLE_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a draw needs from the whole vocabulary, in one pass over ``logits`` [rows, vocab]: each row's largest
    tempered logit ``top`` [rows, 1] (float32), its index ``best`` [rows], and the float64 sums of
    ``exp(logits / T - top)`` over blocks of ``block`` entries [rows, ceil(vocab / block)].

    On CUDA it runs compiled (inside ``draw``'s graph): one fused reduction reading the logits, where the eager
    form writes the float32 tempered logits and their exponentials over the whole vocabulary first (a decode step's
    largest element-wise kernels at batch 256 and a 152k vocabulary)."""
    target = logits.float() / temperature.float()
    top, best = target.max(-1, keepdim=True)
    weights = torch.exp(target - top)
    rows, vocab = weights.shape
    pad = (-vocab) % block
    if pad:
        weights = F.pad(weights, (0, pad))
    return top, best.squeeze(-1), weights.view(rows, -1, block).sum(-1, dtype=torch.float64)


def _draw_core(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
               step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``draw`` after any filtering: tensors in, tensors out, no host sync (so it compiles as one graph)."""
    top, best, sums = row_stats(logits, temperature, SAMPLE_BLOCK)
    rows, vocab = logits.shape
    cdf = sums.cumsum(-1)
    total = cdf[:, -1]
    target = (uniforms(seeds, step).to(cdf.device) * total).unsqueeze(-1)
    which = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)  # [rows, 1]
    before = torch.where(which > 0, cdf.gather(-1, (which - 1).clamp(min=0)), torch.zeros_like(target))
    index = which * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=logits.device)
    inside = torch.exp(logits.gather(-1, index.clamp(max=vocab - 1)).float() / temperature - top) * (index < vocab)
    offset = torch.searchsorted(inside.double().cumsum(-1) + before, target, right=True).clamp(max=SAMPLE_BLOCK - 1)
    choice = (which * SAMPLE_BLOCK + offset).squeeze(-1).clamp(max=vocab - 1)
    chosen = logits.gather(-1, choice.unsqueeze(-1)).float() / temperature  # [rows, 1]
    # u * total can round up to total itself; fall back to the heaviest token then.
    choice = torch.where(torch.exp(chosen - top).squeeze(-1) <= 0, best, choice)
    choice = torch.where(greedy, best, choice)
    chosen = logits.gather(-1, choice.unsqueeze(-1)).float() / temperature
    logprob = (chosen - top).squeeze(-1) - total.log().float()
    return choice, logprob


@functools.cache
def _compiled_core():
    from ctxrl.models.fused import guarded_compile

    return guarded_compile(_draw_core, "the sampler")


def draw(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
         step: int | torch.Tensor, top_k: list[int] | None = None,
         top_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour log-prob, from ``logits`` ``[rows, vocab]`` (any float dtype; the
    maths runs in float32).

    ``temperature`` ``[rows, 1]``; ``greedy`` ``[rows]`` (argmax, reporting the untruncated T=1
    log-prob); ``seeds`` and ``step`` give each row's uniform draw (``uniforms``). Sampled rows
    draw from ``softmax(filter(logits / T))`` by inverse CDF over blocks (``sample_blocked``'s two levels)
    and report that distribution's log-prob. The whole vocabulary is read once (``row_stats``: the row's
    maximum, argmax and block sums), then only the chosen block of each row. On CUDA everything after the
    filter is one compiled graph (``_draw_core``: a decode step's sampler was some sixty small kernels, each
    costing more to run than its work). Without ``top_k``/``top_p`` nothing syncs with the host, so a CUDA
    graph can hold it.
    """
    temperature = temperature.float()
    if top_k is not None and top_p is not None:
        tempered = torch.div(logits, temperature)
        filtered = filter_logits(tempered, top_k, top_p)
        if filtered is not tempered:  # the filter works on tempered logits: the rest runs at T = 1 on them
            logits = torch.where(greedy.unsqueeze(-1), tempered, filtered)
            temperature = torch.ones_like(temperature)
    if not isinstance(step, torch.Tensor):
        step = torch.full_like(seeds, step)
    core = _compiled_core() if logits.is_cuda else _draw_core
    return core(logits, temperature, greedy, seeds, step)
