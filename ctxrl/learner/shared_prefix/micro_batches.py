"""A mini-batch's rows as micro-batches in which the trees worth sharing stay whole (``train.shared_prefix``).

``plan_batch`` cuts the rows into trees (``ctxrl.learner.shared_prefix.plan``); each tree it shares becomes one
micro-batch, a ``TreeBatch``: the rows' usual padded tensors (the loss, its aggregation and every figure read them
as they read any micro-batch) and their ``TreePack``, which the policy's forward pass runs instead of the padded
rows (``ctxrl.learner.forward``). The rows of trees that do not pay, and of a tree that would not fit one
micro-batch, run as before (``ctxrl.learner.batch.micro_batches``).

Fitting one micro-batch: with a token budget, ``plan_batch`` keeps every tree within it (a packed tree is one row
of its nodes, so its padded size is its tokens); without one, a tree of more rows than ``micro_batch_size`` is run
as its rows, unshared. A tree is never split across micro-batches: its rows' log-probs would then be computed
twice and their gradients no longer summed in one pass.

What this does not do: it never shares across data-parallel ranks (each rank packs the trees among its own rows:
the same numbers, less saved when a group is split across ranks), and it does not decide the layout of rows that
share nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ctxrl.learner.batch import Batch, micro_batches
from ctxrl.learner.shared_prefix.layout import TreePack, pack_tree
from ctxrl.learner.shared_prefix.plan import ModelShape, plan_batch

MODES = ("off", "auto")
"""``train.shared_prefix``: ``off`` never shares; ``auto`` shares the trees the plan says pay."""


@dataclass
class TreeBatch(Batch):
    """A micro-batch whose rows run as one packed tree; its padded tensors are those of ``Batch.select``."""

    tree: TreePack | None = None
    saved_tokens: int = 0
    """Tokens the tree computes once that its rows alone would compute more than once."""


def sharing(micro: Batch) -> tuple[int, int]:
    """``(rows, saved tokens)`` of ``micro`` that ran as a shared tree (``(0, 0)`` for any other micro-batch)."""
    return (len(micro), micro.saved_tokens) if isinstance(micro, TreeBatch) else (0, 0)


def tree_micro_batches(batch: Batch, size: int, device: torch.device | str, max_tokens: int, shape: ModelShape, *,
                       padded: bool = True, dtype: torch.dtype = torch.float32,
                       kernel: str = "dense", cost_factor: float = 1.0) -> Iterator[tuple[list[int], Batch]]:
    """``(rows, micro_batch)`` pairs covering ``batch`` (module docstring): first a ``TreeBatch`` per tree that
    ``plan_batch`` shares under ``shape`` and that fits (``max_tokens``, else ``size`` rows), then the other rows as
    ``micro_batches`` cuts them. ``dtype``: the additive mask's, the model's compute dtype. ``kernel``: how the
    trees' attention runs (``layout.KERNELS``); the plan weighs FlexAttention's trees by the pairs they score, and
    every tree's FLOPs ``cost_factor`` times its rows' own (``plan.TREE_COST_ON_FLAT`` where they would run flat)."""
    lengths = batch.lengths.tolist()
    rows = [batch.input_ids[r, :n].tolist() for r, n in enumerate(lengths)]
    rest: list[int] = []
    planned = plan_batch(rows, shape, max_tokens=max_tokens, kernel="tree" if kernel == "flex" else "dense",
                         cost_factor=cost_factor)
    for group, plan in planned if rows else []:
        if not plan.share or (max_tokens <= 0 and len(group) > size):
            rest += group
            continue
        micro = batch.select(group)
        masks = [[0.0] + micro.loss_mask[k, : lengths[r] - 1].tolist() for k, r in enumerate(group)]
        packed = pack_tree([rows[r] for r in group], masks, dtype=dtype, device=device, tree=plan.tree, kernel=kernel)
        yield group, TreeBatch(**micro.to(device).__dict__, tree=packed, saved_tokens=plan.tree.saved_tokens)
    if rest:
        rest.sort()
        remaining = batch.select(rest)
        for picked, micro in micro_batches(remaining, size, device, max_tokens, padded=padded):
            yield [rest[i] for i in picked], micro
