"""A packed tree's attention as FlexAttention: only the key blocks a query's ancestors fill are computed.

The dense pass (``ctxrl.learner.shared_prefix.layout``) hands SDPA an additive ``[L, L]`` mask, and SDPA scores
every pair of a custom mask: a meta-RL trial of 18k tokens pays ``L^2`` scores where its rows alone would pay
far fewer, and on a card that made sharing slower than the flat pass it replaces (``benchmarks/shared_prefix.py
--device cuda``, docs/performance.md). FlexAttention takes the same rule as a function of two positions,
``k <= q < k + size[k]`` (``k`` is ``q`` or an ancestor of ``q``: in pre-order a node's subtree is the ``size``
nodes from it), compiles it into a block-sparse kernel on CUDA, and skips every ``128 x 128`` block no query
of it may see: a sibling branch's, or any key after the query.

How it reaches the model: ``tree_attention`` is registered with transformers' ``AttentionInterface`` under
``KERNEL``; ``flex_tree(model)`` makes it the model's attention for one forward pass, and the ``BlockMask`` goes
in as the attention mask (a 4D mask, which transformers' mask builders hand on as it is). Positions are the
tree's own (``TreePack.position_ids``), as in the dense pass, so the numbers are the same up to float rounding.

On a CPU FlexAttention runs unfused and without a backward pass (PyTorch refuses it), so the learner uses it on
CUDA only (``available``); the CPU tests compare its forward pass with the dense one.
"""

from __future__ import annotations

import contextlib
import functools

import torch

KERNEL = "ctxrl_tree_flex"
"""The name ``tree_attention`` is registered under in transformers' ``AttentionInterface``."""


def available(device: torch.device | str) -> bool:
    """Whether trees on ``device`` run through FlexAttention: CUDA with PyTorch's FlexAttention and transformers'
    attention registry."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        from transformers import AttentionInterface  # noqa: F401
    except ImportError:
        return False
    return True


def tree_block_mask(size: torch.Tensor):
    """The ``BlockMask`` of a packed tree whose node ``k``'s subtree is ``size[k]`` nodes (pre-order): query ``q``
    sees key ``k`` iff ``k <= q < k + size[k]``."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = size.shape[0]

    def ancestor(b, h, q, k):
        return (k <= q) & (q < k + size[k])

    return create_block_mask(ancestor, None, None, n, n, device=size.device)


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def tree_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature over FlexAttention: ``query`` ``[B, H, L, D]``, ``key`` and
    ``value`` ``[B, H_kv, L, D]`` (grouped heads shared), ``attention_mask`` the tree's ``BlockMask``; returns the
    output ``[B, L, H, D]`` and no weights."""
    from torch.nn.attention.flex_attention import flex_attention

    if dropout:
        raise ValueError("a shared-prefix tree runs without attention dropout (the learner's model is in train mode "
                         "with dropout 0 in every supported architecture)")
    kernel = _compiled() if query.is_cuda else flex_attention
    out = kernel(query, key, value, block_mask=attention_mask, scale=scaling,
                 enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(KERNEL, tree_attention)


@contextlib.contextmanager
def flex_tree(model):
    """``model``'s attention is ``tree_attention`` inside (one tree's forward pass), its own again after."""
    _register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = KERNEL
    try:
        yield
    finally:
        config._attn_implementation = before
