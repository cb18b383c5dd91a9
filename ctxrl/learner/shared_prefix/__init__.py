"""Shared-prefix (tree) training: rows that share a prefix run it once, with the same log-probs and gradients.

A GRPO group's completions share their prompt, a meta-RL trial's later attempts repeat its earlier ones,
a ``summarize`` episode's segments share their kept context. Here, one idea a file:

- ``tree``: the rows' token trie (``build_tree``) and their sorted order with shared-prefix links (``sorted_rows``);
- ``layout``: a tree as one packed sequence with an ancestor mask (``pack_tree``), its per-node log-probs
  (``tree_logprobs``) and their map back to the rows' shifted ``[B, T-1]`` layout (``TreePack.unpack``);
- ``plan``: tokens and estimated FLOPs with and without sharing, whether a tree is worth packing
  (``plan_sharing``), and a batch cut into the trees worth packing (``plan_batch``);
- ``micro_batches``: a mini-batch's rows as micro-batches, each shared tree whole in one (``TreeBatch``), which the
  learner's forward pass runs as its tree (``ctxrl.learner.forward``, ``train.shared_prefix``).

Checked in float64 against the padded forward pass (``tests/test_shared_prefix.py``); figures from
``benchmarks/shared_prefix.py`` (``docs/performance.md``); ``Learner.update`` with and without sharing in
``tests/test_learner_shared_prefix.py``.
"""

from ctxrl.learner.shared_prefix.layout import TreePack, pack_tree, tree_logprobs
from ctxrl.learner.shared_prefix.plan import ModelShape, SharingPlan, plan_batch, plan_sharing
from ctxrl.learner.shared_prefix.tree import PrefixTree, build_tree, sorted_rows

__all__ = ["ModelShape", "PrefixTree", "SharingPlan", "TreePack", "build_tree", "pack_tree", "plan_batch",
           "plan_sharing", "sorted_rows", "tree_logprobs"]
