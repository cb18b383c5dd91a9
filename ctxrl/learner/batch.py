"""Training rows to tensors: what the learner takes.

``collate`` pads rows (``TrainSequence``, or anything with ``input_ids``, ``loss_mask`` and
``behavior_logprobs``) on the right into one ``Batch`` on the CPU. Token alignment: for a sequence
``x[0..T)``, position ``t`` of the shifted tensors predicts token ``x[t+1]`` from the logits at
``t``, so ``loss_mask``, behaviour log-probs, advantages and the critic's targets are taken from
``[1:]`` of each row, the logits from ``[:-1]``. ``Batch.select(rows)`` takes rows (a mini- or
micro-batch) cut to their longest, exactly the tensors collating those rows alone would give.

A ``Batch`` is plain tensors indexed by row: nothing in it refers back to episode objects, so it
can be built in one process and trained on in another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Batch:
    """Right-padded tensors of ``B`` rows: ``input_ids`` / ``attention_mask`` [B, T], the rest [B, T-1]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    """The behaviour log-probs (the sampler's) of the sampled tokens, 0 elsewhere."""
    advantages: torch.Tensor
    lengths: torch.Tensor
    """[B] tokens per row."""
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None
    """Where the critic's value is trained (None: at every sampled token)."""
    recomputed: torch.Tensor | None = None
    """The learner's own log-probs of the sampled tokens before the update (``old_logprobs="recompute"``)."""
    teacher_ids: torch.Tensor | None = None
    """[B, T-1, K]: a distillation teacher's ``K`` likeliest next tokens at each position (``algo.distill.top_k``)."""
    teacher_probs: torch.Tensor | None = None
    """[B, T-1, K]: their probabilities under the teacher (0 where the loss mask is 0)."""
    offpolicy_weights: torch.Tensor | None = None
    """An off-policy correction's weight of each token's loss (``algo.offpolicy``; 0 where the loss mask is 0)."""
    env_mask: torch.Tensor | None = None
    """1 where the token was written by the environment (``ctxrl.types.environment_mask``): the world-model loss's
    tokens (``algo.world_model_coef``)."""

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1:]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: Sequence[int] | torch.Tensor) -> Batch:
        """The given rows, cut to the longest of them."""
        index = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows, dtype=torch.long)
        width = int(self.lengths[index].max()) if len(index) else 1
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "lengths":
                out[f.name] = value if value is None else value[index]
            elif f.name in ("input_ids", "attention_mask"):
                out[f.name] = value[index, :width]
            else:
                out[f.name] = value[index, : width - 1]
        return Batch(**out)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                        for f in dataclasses.fields(self)})


def collate(rows: Sequence[Any], pad_token_id: int, device: torch.device | str = "cpu",
            advantages: Sequence[float] | Sequence[Sequence[float]] | None = None) -> Batch:
    """Pad and shift ``rows``.

    Advantages come from each row's own ``advantages`` (a ``TrainSequence``), or from
    ``advantages``: one float per row (broadcast over its sampled tokens) or one list per row
    aligned with its ``input_ids``. They are zeroed wherever the loss mask is 0. A row's critic
    targets (``returns``, ``old_values``, ``value_mask``) are collated when any row has them.
    """
    if not rows:
        raise ValueError("collate: no rows")
    n = len(rows)
    lengths = torch.tensor([len(r.input_ids) for r in rows], dtype=torch.long)
    width = int(lengths.max())
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width))
    old = torch.zeros((n, width))
    for row, r in enumerate(rows):
        length = len(r.input_ids)
        if not len(r.loss_mask) == len(r.behavior_logprobs) == length:
            raise ValueError(f"collate: row {row} has {length} ids, {len(r.loss_mask)} mask values and "
                             f"{len(r.behavior_logprobs)} behaviour log-probs; they must be equal")
        ids[row, :length] = torch.tensor(r.input_ids)
        attn[row, :length] = 1
        mask[row, :length] = torch.tensor(r.loss_mask, dtype=torch.float32)
        old[row, :length] = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
    if advantages is None and all(hasattr(r, "advantages") for r in rows):
        advantages = [r.advantages for r in rows]
    adv = _per_token(rows, advantages, n, width, "advantages") * mask
    targets: dict[str, torch.Tensor | None] = {}
    for name in ("returns", "old_values", "value_mask"):
        values = [getattr(r, name, None) for r in rows]
        if any(v is not None for v in values):
            if name == "value_mask":  # rows without one train the value at their sampled tokens
                values = [v if v is not None else r.loss_mask for v, r in zip(values, rows)]
            elif any(v is None for v in values):
                raise ValueError(f"collate: some rows have {name} and some do not")
            targets[name] = _per_token(rows, values, n, width, name)[:, 1:].to(device)
        else:
            targets[name] = None
    env = [getattr(r, "env_mask", None) for r in rows]
    targets["env_mask"] = (_per_token(rows, [e if e is not None else [0] * len(r.input_ids) for e, r in zip(env, rows)],
                                      n, width, "env_mask")[:, 1:].to(device)
                           if any(e is not None for e in env) else None)
    targets.update(_teacher_topk(rows, width, device))
    return Batch(ids.to(device), attn.to(device), mask[:, 1:].to(device), old[:, 1:].to(device),
                 adv[:, 1:].to(device), lengths.to(device), **targets)


def _teacher_topk(rows: Sequence[Any], width: int, device) -> dict[str, torch.Tensor | None]:
    """The rows' teacher top-K ids and probabilities as [n, width-1, K] (shifted like the log-probs), or Nones."""
    ids = [getattr(r, "teacher_ids", None) for r in rows]
    probs = [getattr(r, "teacher_probs", None) for r in rows]
    if all(i is None for i in ids) and all(p is None for p in probs):
        return {"teacher_ids": None, "teacher_probs": None}
    if any(i is None for i in ids) or any(p is None for p in probs):
        raise ValueError("collate: some rows have a teacher's top-K and some do not")
    k = max((len(entry) for row in ids for entry in row), default=0)
    out_ids = torch.zeros((len(rows), width, k), dtype=torch.long)
    out_probs = torch.zeros((len(rows), width, k))
    for row, (r, i, p) in enumerate(zip(rows, ids, probs)):
        if not len(i) == len(p) == len(r.input_ids):
            raise ValueError(f"collate: row {row} has {len(r.input_ids)} tokens but {len(i)} teacher top-K id lists "
                             f"and {len(p)} probability lists")
        if i and any(len(entry) != k for entry in i) or any(len(a) != len(b) for a, b in zip(i, p)):
            raise ValueError(f"collate: row {row}'s teacher top-K lists are not all {k} long")
        if i:
            out_ids[row, : len(i)] = torch.tensor(i, dtype=torch.long)
            out_probs[row, : len(p)] = torch.tensor(p, dtype=torch.float32)
    return {"teacher_ids": out_ids[:, 1:].to(device), "teacher_probs": out_probs[:, 1:].to(device)}


def _per_token(rows: Sequence[Any], values: Any, n: int, width: int, what: str) -> torch.Tensor:
    out = torch.zeros((n, width))
    if values is None:
        return out
    if len(values) != n:
        raise ValueError(f"collate: {len(values)} {what} for {n} rows")
    for row, (r, a) in enumerate(zip(rows, values)):
        if isinstance(a, (int, float)):
            out[row] = float(a)
        elif len(a) != len(r.input_ids):
            raise ValueError(f"collate: row {row} has {len(r.input_ids)} tokens but {len(a)} {what}")
        else:
            out[row, : len(a)] = torch.tensor(a, dtype=torch.float32)
    return out


# -- micro-batches ----------------------------------------------------------------------------------
PADDED_BOUND = 4
"""A flat micro-batch's rows x its longest row stays within this many times its token budget (``pack``)."""


def pack(lengths: Sequence[int], max_rows: int, max_tokens: int = 0, *, padded: bool = True) -> list[list[int]]:
    """Row indices of each micro-batch.

    ``max_tokens = 0``: consecutive rows, ``max_rows`` at a time. Otherwise rows go longest first
    into micro-batches of at most ``max_rows`` rows whose padded size (rows x longest row) stays
    within ``max_tokens``; a row longer than the budget is a micro-batch of its own. Sorting by
    length keeps the padding small, so a micro-batch of short rows holds many of them. ``padded=False``
    (the flat forward pass, which runs no padding): the rows' own tokens stay within ``max_tokens``, and
    their padded size within ``PADDED_BOUND`` times it (the loss's ``[rows, longest]`` tensors, a teacher's
    ``[rows, longest, k]`` ids, stay bounded when one long row leads many short ones).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    n = len(lengths)
    if max_tokens <= 0:
        return [list(range(start, min(start + max_rows, n))) for start in range(0, n, max_rows)]
    groups: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        grid = (len(current) + 1) * lengths[current[0]] if current else lengths[i]
        over = grid > max_tokens if padded else (held + lengths[i] > max_tokens or grid > PADDED_BOUND * max_tokens)
        if current and (len(current) >= max_rows or over):
            groups.append(current)
            current, held = [], 0
        current.append(i)
        held += lengths[i]
    if current:
        groups.append(current)
    return groups


def micro_batches(batch: Batch, size: int, device: torch.device | str, max_tokens: int = 0, *, padded: bool = True):
    """``(rows, micro_batch)`` pairs covering ``batch`` (``pack``), each cut to its longest row and on ``device``."""
    for rows in pack(batch.lengths.tolist(), size, max_tokens, padded=padded):
        yield rows, batch.select(rows).to(device)


def per_token_rows(batch: Batch, device, micro_batch_size: int, fn, max_tokens: int = 0, *,
                   padded: bool = True, split=micro_batches) -> list[list[float]]:
    """``fn(micro_batch) -> [b, T-1]`` over micro-batches, as one list per row of ``batch`` (in its order), aligned
    with the row's ``input_ids`` (index 0, the first prompt token, gets 0). ``split``: what cuts the micro-batches,
    ``micro_batches``' signature (a ``Forward``'s, whose shared trees stay whole)."""
    out: list[list[float] | None] = [None] * len(batch)
    for rows, micro in split(batch, micro_batch_size, device, max_tokens, padded=padded):
        values = fn(micro).detach().float().cpu()
        for k, (row, n) in enumerate(zip(rows, micro.lengths.tolist())):
            out[row] = [0.0] + values[k, : int(n) - 1].tolist()
    return out
