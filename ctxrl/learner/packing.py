"""Sequences packed without padding for the learner's forward pass (``train.pack_sequences``).

A micro-batch of right-padded rows spends compute on padding when its lengths differ (a GRPO
group's completions run from a few tokens to the budget). Packed, several sequences share a row:
rows are filled first-fit by decreasing length up to the longest sequence (so no row is longer
than the padded batch's, and attention never costs more), each sequence keeps its own positions
(restarting at 0), and a block-diagonal causal mask keeps it from seeing its neighbours. The
log-probs come back in the padded layout (``unpack``), so the loss, its aggregation over
sequences and every metric are computed exactly as without packing: only the forward pass (and
its backward) changes shape. Equal to the padded path in log-probs and gradients up to the
attention kernel's rounding (``tests/test_packing.py``).

The mask is an additive 4D mask handed to the model as ``attention_mask``; HF models take a 4D
mask as it is (their own causal/padding mask is not built), for SDPA and eager attention alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor
    """[R, L] packed ids (a row's tail past its last sequence is padding, a sequence of its own)."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    """[R, 1, L, L] additive: 0 where a query may attend, the dtype's minimum elsewhere."""
    source: tuple[torch.Tensor, torch.Tensor]
    """Padded (row, position) of every predicted token, in the shifted ``[B, T-1]`` layout."""
    target: tuple[torch.Tensor, torch.Tensor]
    """Its packed (row, position) in the shifted ``[R, L-1]`` layout."""
    shape: tuple[int, int]
    """The padded shifted shape ``[B, T-1]``."""

    def to_packed(self, values: torch.Tensor) -> torch.Tensor:
        """A padded ``[B, T-1]`` tensor (a mask) in the packed ``[R, L-1]`` layout, 0 elsewhere."""
        out = values.new_zeros(self.input_ids.shape[0], self.input_ids.shape[1] - 1)
        out[self.target] = values[self.source]
        return out

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Packed ``[R, L-1]`` values back in the padded ``[B, T-1]`` layout, 0 elsewhere (differentiable)."""
        out = values.new_zeros(self.shape)
        out[self.source] = values[self.target]
        return out


def bins(lengths: list[int]) -> list[list[int]]:
    """First-fit decreasing: sequence indices per row, no row longer than the longest sequence."""
    capacity = max(lengths, default=0)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def pack(input_ids: torch.Tensor, lengths: torch.Tensor, pad_id: int, dtype: torch.dtype) -> Packed:
    """Pack the right-padded rows of ``input_ids`` ([B, T], row ``i`` holding ``lengths[i]`` tokens)."""
    device = input_ids.device
    n = lengths.tolist()
    layout = bins(n)
    width = max(n, default=1)
    ids = torch.full((len(layout), width), pad_id, dtype=input_ids.dtype, device=device)
    positions = torch.zeros((len(layout), width), dtype=torch.long, device=device)
    docs = torch.empty((len(layout), width), dtype=torch.long, device=device)
    src_rows, src_cols, dst_rows, dst_cols = [], [], [], []
    for r, members in enumerate(layout):
        offset = 0
        for i in members:
            length = n[i]
            ids[r, offset:offset + length] = input_ids[i, :length]
            positions[r, offset:offset + length] = torch.arange(length, device=device)
            docs[r, offset:offset + length] = i
            src_rows += [i] * (length - 1)
            src_cols += range(length - 1)
            dst_rows += [r] * (length - 1)
            dst_cols += range(offset, offset + length - 1)
            offset += length
        positions[r, offset:] = torch.arange(width - offset, device=device)
        docs[r, offset:] = -1 - r  # the tail: a sequence of its own
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = (docs.unsqueeze(2) == docs.unsqueeze(1)) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return Packed(ids, positions, mask.unsqueeze(1), (index(src_rows), index(src_cols)),
                  (index(dst_rows), index(dst_cols)), (input_ids.shape[0], input_ids.shape[1] - 1))


@dataclass
class Flat:
    """A micro-batch's sequences laid end to end: one row, no padding (``ctxrl.learner.flat``)."""

    ids: torch.Tensor
    """[N] every sequence's tokens, one after another."""
    positions: torch.Tensor
    """[N] each token's position within its sequence."""
    cu_seqlens: torch.Tensor
    """[S + 1] int32: where each sequence starts, then N."""
    longest: int
    """At least the longest sequence: the padded width (no host sync to find the true longest)."""
    starts: torch.Tensor
    """[S] long: where each sequence starts."""

    def index(self, wanted: torch.Tensor) -> torch.Tensor:
        """Flat index of each True entry of a padded shifted ``[S, T-1]`` mask (row-major order): the
        position whose hidden state predicts that entry's token (the token itself is at index + 1)."""
        rows, cols = wanted.nonzero(as_tuple=True)
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        if bool((cols >= lengths[rows] - 1).any()):
            raise ValueError("a mask entry lies past its row's last token: the flat layout would score the next "
                             "sequence's token there")
        return self.starts[rows] + cols


def flatten(input_ids: torch.Tensor, lengths: torch.Tensor) -> Flat:
    """Lay the right-padded rows of ``input_ids`` ([S, T], row ``i`` holding ``lengths[i]`` tokens) end to end."""
    steps = torch.arange(input_ids.shape[1], device=input_ids.device)
    lengths = lengths.to(input_ids.device)
    live = steps.unsqueeze(0) < lengths.unsqueeze(1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = lengths.cumsum(0)
    return Flat(input_ids[live], steps.expand_as(input_ids)[live], cu, input_ids.shape[1], cu[:-1].long())
