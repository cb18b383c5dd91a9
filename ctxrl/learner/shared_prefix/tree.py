"""Finding the prefixes rows share: a token trie of the rows, and the groups worth packing together.

Why a general trie, not one prefix plus suffixes: the three workloads ctxrl trains on are trees of
different depths. A GRPO group is one prompt and eight completions (depth one). A meta-RL trial's
attempt ``k`` repeats attempts ``1..k-1`` (a chain: each row a prefix of the next, so the whole trial
is scored by the forward pass of its longest row). A group of such trials is a prompt, then a chain
per trial. A depth-one tree would share only the prompt of that last case and compute every earlier
attempt again in each later one; the trie shares each token once, whatever the shape, at no extra
complexity in the packing (a token attends to its ancestors, which a depth-one tree needs too).

The trie is of tokens, not text (ids are compared exactly), and its nodes are numbered in pre-order
with children in the order rows first reach them: row 0's tokens come first, in order, then the tokens
of row 1 that row 0 does not hold, and so on. Every number the packing needs follows from that order
(``ctxrl.learner.shared_prefix.layout``): a node's ancestors are the nodes ``k <= q`` whose subtree
reaches ``q``.

What this does not do: it never merges tokens that differ (no approximate sharing), and it does not
look at loss masks (a log-prob depends on the ids alone; the masks decide only which log-probs anybody
needs, ``layout``). Rows of a batch that share only a system prompt would all land in one tree: which rows
to pack together is the plan's choice (``ctxrl.learner.shared_prefix.plan.plan_batch``, from ``sorted_rows``),
since a packed tree's attention mask is quadratic in its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixTree:
    """The token trie of ``rows``: ``L`` nodes (one per distinct token-with-its-prefix) in pre-order."""

    ids: list[int]
    """[L] each node's token id."""
    parent: list[int]
    """[L] the node before it on every row through it (-1 for a row's first token): the position whose
    hidden state predicts this node's token."""
    depth: list[int]
    """[L] its position within each row through it (the position id the packed forward gives it)."""
    size: list[int]
    """[L] nodes in its subtree, itself included: its descendants are nodes ``q+1 .. q+size-1``."""
    row_nodes: list[list[int]]
    """Per row, the node of each of its tokens (``row_nodes[r][t]`` holds token ``t`` of row ``r``)."""

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def row_tokens(self) -> int:
        """Tokens of the rows as they are (unshared, no padding)."""
        return sum(len(nodes) for nodes in self.row_nodes)

    @property
    def saved_tokens(self) -> int:
        """Tokens the tree computes once that the rows would compute more than once."""
        return self.row_tokens - len(self.ids)


def as_ids(row, where: str) -> list[int]:
    """A row (a list or a 1D tensor of ids) as a list of ints; a clear error for anything else."""
    if isinstance(row, torch.Tensor):
        if row.dim() != 1:
            raise ValueError(f"{where} is a {row.dim()}D tensor of shape {tuple(row.shape)}; give each row as a 1D "
                             "tensor or list of token ids")
        if row.is_floating_point():
            raise ValueError(f"{where} holds {row.dtype} values; token ids are integers")
        row = row.tolist()
    out = list(row)
    if not out:
        raise ValueError(f"{where} has no tokens; leave empty rows out of the batch")
    for token in out:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"{where} holds {token!r}, which is not a token id (an int >= 0)")
    return out


def build_tree(rows: Sequence) -> PrefixTree:
    """The token trie of ``rows`` (lists or 1D tensors of ids), nodes in pre-order (module docstring)."""
    if len(rows) == 0:
        raise ValueError("build_tree: no rows")
    # insertion: a node per new (prefix, token); children kept in the order rows first reach them
    tokens: list[int] = []
    children: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    paths: list[list[int]] = []
    for r, row in enumerate(rows):
        level, path = roots, []
        for token in as_ids(row, f"row {r}"):
            node = level.get(token)
            if node is None:
                node = level[token] = len(tokens)
                tokens.append(token)
                children.append({})
            path.append(node)
            level = children[node]
        paths.append(path)
    # pre-order numbering (iterative: a long chain would overflow Python's recursion)
    order: list[int] = []
    stack = list(reversed(roots.values()))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node].values()))
    number = [0] * len(tokens)
    for q, node in enumerate(order):
        number[node] = q
    parent, depth = [-1] * len(order), [0] * len(order)
    for node, kids in enumerate(children):
        for kid in kids.values():
            parent[number[kid]] = number[node]
    for q in range(len(order)):  # pre-order: a parent is numbered before its children
        depth[q] = 0 if parent[q] < 0 else depth[parent[q]] + 1
    size = [1] * len(order)
    for q in range(len(order) - 1, -1, -1):
        if parent[q] >= 0:
            size[parent[q]] += size[q]
    return PrefixTree([tokens[node] for node in order], parent, depth, size,
                      [[number[node] for node in path] for path in paths])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sorted_rows(rows: Sequence) -> tuple[list[int], list[int]]:
    """The rows' indices in lexicographic order of their ids, and how many leading tokens each shares with the one
    before it in that order (0 for the first).

    Sorted, the prefix two rows share is the least one their neighbours between them share, so a run of rows whose
    links are all at least ``N`` is one subtree of the trie below depth ``N``, and cutting a run at its weakest link
    parts it where the trie branches highest: a batch's groups part at the system prompt, a group's rows at its
    prompt. A row's new tokens in a run's trie are those past its link (``ctxrl.learner.shared_prefix.plan``)."""
    ids = [as_ids(row, f"row {r}") for r, row in enumerate(rows)]
    order = sorted(range(len(ids)), key=lambda r: (ids[r], r))
    links = [0] + [common_prefix(ids[a], ids[b]) for a, b in zip(order, order[1:])]
    return order, links
