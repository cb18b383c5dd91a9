"""The prefill of an admission round: the leaders' new prompt tokens, packed without padding, into their slots.

In order, for a ``Round`` (``admission``):

1. Slots that reuse a prefix kept in another slot (``Placement.source``) get a copy of it, before
   any prefill overwrites that slot.
2. The leaders' new tokens (each prompt past what its slot holds) run through the model, packed
   end to end: one forward per group of at most ``prefill_tokens`` new tokens (a longer prompt is
   a group of its own). Each token's keys and values land in its slot at its position.
3. Each follower's slot gets a copy of its leader's keys and values.

The result is the logits at each starting request's last prompt position (a follower's are its
leader's), from which its first token is drawn (``decode.Decoder.start``).
"""

from __future__ import annotations

import torch

from ctxrl.engine.fast.admission import Round
from ctxrl.engine.fast.model import Batch, DecoderView, SlotCache, bucket, to_device
from ctxrl.engine.fast.rows import Request
from ctxrl.engine.fast.slots import Placement


def prefill_round(round_: Round, view: DecoderView, cache: SlotCache, *, prefill_tokens: int,
                  stats: dict) -> torch.Tensor:
    """Logits ``[len(round_.requests), vocab]``; see the module docstring. Counts ``stats["prefill_tokens"]``."""
    # copies read kept prefixes before any prefill overwrites them
    cache.copy_prefixes([(p.source, p.slot, p.cached) for _, p in round_.leaders if p.source is not None])
    logits = _prefill(round_.leaders, view, cache, prefill_tokens, stats)
    cache.copy_prefixes([(round_.leaders[leader][1].slot, slot, len(request.prompt_ids))
                         for request, slot, leader in round_.followers])
    return logits[to_device(round_.logit_rows, logits.device)]


def _prefill(leaders: list[tuple[Request, Placement]], view: DecoderView, cache: SlotCache, prefill_tokens: int,
             stats: dict) -> torch.Tensor:
    """Logits at the last prompt position of each leader; prefills only what its slot lacks."""
    out: list[torch.Tensor] = []
    group: list[tuple[Request, Placement]] = []
    size = 0
    for item in leaders:
        new = len(item[0].prompt_ids) - item[1].cached
        if group and size + new > prefill_tokens:
            out.append(_prefill_group(group, view, cache, stats))
            group, size = [], 0
        group.append(item)
        size += new
    out.append(_prefill_group(group, view, cache, stats))
    return torch.cat(out)


def _prefill_group(group: list[tuple[Request, Placement]], view: DecoderView, cache: SlotCache,
                   stats: dict) -> torch.Tensor:
    tokens: list[int] = []
    for request, placement in group:
        tokens += request.prompt_ids[placement.cached:]
    starts = [p.cached for _, p in group]
    counts = [len(r.prompt_ids) - p.cached for r, p in group]
    longest = max(len(r.prompt_ids) for r, _ in group)
    dev = view.device
    rows = [p.slot for _, p in group]
    positions, slots, row_of, offset, last = token_layout(to_device([starts, counts, rows], dev), len(tokens))
    batch = Batch(tokens=to_device(tokens, dev), positions=positions, slots=slots, rows=to_device(rows, dev),
                  row_of=row_of, offset=offset, width=max(counts), n_rows=len(group),
                  key_len=bucket(longest, 64, cache.capacity))
    stats["prefill_tokens"] += len(tokens)
    stats["prefill_forwards"] += 1
    return view.forward(batch, cache, last=last)


def token_layout(rows: torch.Tensor, total: int) -> tuple[torch.Tensor, ...]:
    """Where each of ``total`` packed prefill tokens goes, from ``rows`` ``[3, n]``: each row's first new position,
    its count of new tokens and its slot. Returns per token its position, its slot, its row and its offset in the
    row, and per row the index of its last token. Computed on the rows' device from ``3 n`` values (the host
    sends those, not five lists of ``total`` each), without a sync (``output_size`` is given)."""
    starts, counts, slots = rows[0], rows[1], rows[2]
    n = counts.shape[0]
    ends = counts.cumsum(0)
    row_of = torch.repeat_interleave(torch.arange(n, device=rows.device), counts, output_size=total)
    offset = torch.arange(total, device=rows.device) - (ends - counts)[row_of]
    return starts[row_of] + offset, slots[row_of], row_of, offset, ends - 1
