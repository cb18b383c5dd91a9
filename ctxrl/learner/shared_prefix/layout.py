"""A prefix tree as one packed sequence, its forward pass, and its log-probs back in the rows' layout.

The tree's nodes (``ctxrl.learner.shared_prefix.tree``), in pre-order, are one sequence of ``L`` tokens:
the shared prefix once, then each branch. Each token's position id is its position in its rows (a branch's
positions restart at its parent's plus one), and the 4D attention mask lets a token see exactly its
ancestors and itself: the prefix and its own branch's earlier tokens, never a sibling branch. Every
token's hidden state is then the one the unshared forward pass of any of its rows computes, and so is the
gradient, summed over the rows that share it (autograd sums it where one log-prob feeds several rows).

**The boundary.** The log-prob of a token is read from its *parent*'s position, not the position before it
in the packed sequence: the first token of a branch is predicted by the last token of the prefix, whose
packed neighbour is (for every branch but the first) the end of a sibling branch. So the packed log-probs
are ``log_softmax(logits[parent[q]])[ids[q]]``, one per node, and ``unpack`` hands row ``r`` the log-prob of
its token ``t+1`` at ``[r, t]``, the shifted ``[B, T-1]`` layout of ``ctxrl.learner.batch``. A prefix token's
log-prob is one number that every row through it reads.

**Why one masked pass, not two.** The other exact scheme runs the prefix, keeps its keys and values
(``past_key_values``, not detached, so the suffixes' gradients reach the prefix through them) and runs the
suffixes as a batch over the expanded cache. It needs one level per pass (a meta-RL trial's chain is as
many passes as attempts), a cache expanded per suffix, and its own unpacking; the masked pass is one call
of the model as it is, any depth, and the same 4D-mask convention ``ctxrl.learner.packing`` already uses.
Its cost is the mask: SDPA and eager attention compute all ``L x L`` scores of a custom mask, where the
flat pass's variable-length kernel computes only the causal half of each row (``plan`` weighs that, and
says when the two-pass scheme, whose suffix attention is a plain cached causal one, would win).

``tree_logprobs`` here runs the model's full logits (for tests and the benchmark); the learner's pass runs the
chunked output head of ``ctxrl.learner.logprobs`` (``tree_token_logprobs``) over micro-batches cut by
``ctxrl.learner.shared_prefix.micro_batches``. What this does not do: the flat decoder's variable-length kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ctxrl.learner.shared_prefix.tree import PrefixTree, build_tree
from ctxrl.models.kernels import attention_kernels

KERNELS = ("dense", "flex")
"""How a packed tree's attention runs: an additive ``[L, L]`` mask through the model's own attention (``dense``),
or FlexAttention's block-sparse kernel (``flex``, CUDA: ``ctxrl.learner.shared_prefix.flex``)."""


@dataclass
class TreePack:
    """One tree packed as a batch of one sequence of ``L`` tokens, and the map back to its ``B`` rows."""

    input_ids: torch.Tensor
    """[1, L] the nodes' ids in pre-order."""
    position_ids: torch.Tensor
    """[1, L] each node's position in its rows."""
    attention_mask: torch.Tensor | None
    """[1, 1, L, L] additive: 0 where a token may attend (its ancestors and itself), the dtype's minimum elsewhere;
    None for a tree packed for FlexAttention, whose mask is ``size`` (``ctxrl.learner.shared_prefix.flex``)."""
    parent: torch.Tensor
    """[L] long: the node whose hidden state predicts each node's token (-1: a row's first token, never scored)."""
    wanted: torch.Tensor
    """[L] bool: nodes whose log-prob some row's loss mask needs (all scored nodes when no masks were given)."""
    row_nodes: torch.Tensor
    """[B, T] long: the node of each row's tokens, -1 past a row's end."""
    size: torch.Tensor | None = None
    """[L] long: each node's subtree in nodes (itself included); query ``q`` sees key ``k`` iff
    ``k <= q < k + size[k]``."""

    @property
    def kernel(self) -> str:
        """``dense`` (an additive mask through the model's own attention) or ``flex`` (FlexAttention)."""
        return "dense" if self.attention_mask is not None else "flex"

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens per row."""
        return (self.row_nodes >= 0).sum(1)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-node ``[L]`` values (log-probs) as the rows' shifted ``[B, T-1]``: ``[r, t]`` is row ``r``'s token
        ``t+1``'s value, 0 past the row's end. Differentiable; a shared node's value is read by every row."""
        if values.shape != self.parent.shape:
            raise ValueError(f"unpack: values of shape {tuple(values.shape)}, expected one per node "
                             f"({tuple(self.parent.shape)})")
        index = self.row_nodes[:, 1:]
        live = index >= 0
        return torch.where(live, values[index.clamp(min=0)], values.new_zeros(()))


def pack_tree(rows: Sequence, loss_masks: Sequence | None = None, *, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", tree: PrefixTree | None = None, kernel: str = "dense") -> TreePack:
    """Pack ``rows`` (lists or 1D tensors of ids) as one tree (module docstring).

    ``loss_masks``: per row, one 0/1 value per token aligned with its ids (a ``TrainSequence``'s ``loss_mask``);
    they set ``wanted`` and nothing else. ``dtype``: the additive mask's, the model's compute dtype.
    ``tree``: ``build_tree(rows)`` when the caller already has it. ``kernel``: ``dense`` builds the additive
    ``[L, L]`` mask; ``flex`` leaves it out (FlexAttention builds its block mask from ``size``).
    """
    if kernel not in KERNELS:
        raise ValueError(f"pack_tree: kernel must be one of {', '.join(KERNELS)}, not {kernel!r}")
    tree = tree if tree is not None else build_tree(rows)
    if len(tree.row_nodes) != len(rows):
        raise ValueError(f"pack_tree: the tree holds {len(tree.row_nodes)} rows, {len(rows)} were given")
    n = len(tree)
    parent = torch.tensor(tree.parent, dtype=torch.long, device=device)
    width = max(len(nodes) for nodes in tree.row_nodes)
    row_nodes = torch.full((len(rows), width), -1, dtype=torch.long, device=device)
    for r, nodes in enumerate(tree.row_nodes):
        row_nodes[r, : len(nodes)] = torch.tensor(nodes, dtype=torch.long, device=device)
    wanted = torch.zeros(n, dtype=torch.bool, device=device)
    if loss_masks is None:
        wanted = parent >= 0
    else:
        if len(loss_masks) != len(rows):
            raise ValueError(f"pack_tree: {len(loss_masks)} loss masks for {len(rows)} rows; give one per row")
        for r, (mask, nodes) in enumerate(zip(loss_masks, tree.row_nodes)):
            mask = torch.as_tensor(mask, device=device)
            if mask.dim() != 1 or mask.shape[0] != len(nodes):
                raise ValueError(f"pack_tree: row {r} has {len(nodes)} tokens but a loss mask of shape "
                                 f"{tuple(mask.shape)}; give one 0/1 value per token, aligned with its ids")
            if bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError(f"pack_tree: row {r}'s loss mask holds values other than 0 and 1")
            wanted[torch.tensor(nodes, device=device)[mask.bool()]] = True
        wanted &= parent >= 0  # a row's first token has no log-prob (the shifted layout has no place for it)
    size = torch.tensor(tree.size, dtype=torch.long, device=device)
    mask = None
    if kernel == "dense":  # q sees k iff k is an ancestor of q or q itself: in pre-order, k <= q < k + size[k]
        index = torch.arange(n, device=device)
        allowed = (index.unsqueeze(0) <= index.unsqueeze(1)) & (index.unsqueeze(1) < (index + size).unsqueeze(0))
        mask = torch.zeros((n, n), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        mask = mask.view(1, 1, n, n)
    return TreePack(torch.tensor(tree.ids, dtype=torch.long, device=device).unsqueeze(0),
                    torch.tensor(tree.depth, dtype=torch.long, device=device).unsqueeze(0),
                    mask, parent, wanted, row_nodes, size)


def tree_inputs(model, packed: TreePack):
    """``(model inputs, context)`` for one forward pass of ``packed``: its ids, positions and mask (the additive one,
    or the ``BlockMask`` made from ``size`` inside ``flex_tree``) and the context that picks the attention kernel."""
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False}
    if packed.kernel == "dense":
        return {**inputs, "attention_mask": packed.attention_mask}, attention_kernels(packed.input_ids.device)
    from ctxrl.learner.shared_prefix.flex import flex_tree, tree_block_mask

    return {**inputs, "attention_mask": tree_block_mask(packed.size)}, flex_tree(model)


def tree_logprobs(model, packed: TreePack, *, temperature: float = 1.0, only_wanted: bool = True) -> torch.Tensor:
    """Per-node log-probs ``[L]`` of a packed tree under ``model``: node ``q``'s token scored from its parent's
    position (0 at a row's first token, and at nodes no loss mask needs when ``only_wanted``). Through the model's
    full logits, in at least float32 (float64 for a float64 model)."""
    if temperature <= 0:
        temperature = 1.0
    inputs, kernel = tree_inputs(model, packed)
    with kernel:
        logits = model(**inputs).logits[0]
    scored = packed.wanted if only_wanted else packed.parent >= 0
    at = scored.nonzero(as_tuple=True)[0]
    states = logits[packed.parent[at]]
    states = states if states.dtype == torch.float64 else states.float()
    if temperature != 1.0:
        states = states / temperature
    targets = packed.input_ids[0, at]
    values = states.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(states, dim=-1)
    return values.new_zeros(packed.parent.shape).index_put((at,), values)
