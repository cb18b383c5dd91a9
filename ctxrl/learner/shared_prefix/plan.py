"""When sharing a prefix pays: training FLOPs of rows with and without their tree, and the decision.

A training token costs about ``6 N`` FLOPs (``N``: the parameters its forward pass multiplies by; forward
``2 N``, backward ``4 N``), and attention adds ``12 * layers * W`` per (query, key) pair it scores (``W``:
query heads x head dim; ``4 W`` forward for the scores and the weighted values, twice that backward). The
figures count matrix products only, as MFU does.

Three ways to run the same rows:

- **unshared**: each row alone, causal: ``n (n + 1) / 2`` pairs a row of ``n`` tokens (the flat pass's
  variable-length kernel, which skips the masked half; the baseline the plan compares against);
- **dense** tree: the packed tree through SDPA or eager attention with its 4D mask
  (``ctxrl.learner.shared_prefix.layout``): fewer tokens, but all ``L x L`` scores of the packed sequence;
- **tree** kernel: only the pairs a token attends (its ancestors and itself), what a tree-attention kernel
  or the two-pass prefix/suffix scheme computes; never more than unshared.

The dense mask's ``L^2`` is the catch: a group of 8 completions of 2,000 tokens after a 100-token prompt
saves 700 tokens of 16,800 but scores 16,100^2 pairs instead of 8 x 2,100^2 / 2, so on a 0.5B model it costs
more than it saves. ``plan_sharing`` shares a tree only when it saves at least ``min_shared_tokens`` over at
least ``min_rows`` rows and its estimated FLOPs under the chosen kernel are below the unshared ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxrl.learner.shared_prefix.tree import PrefixTree, as_ids, build_tree, sorted_rows

KERNELS = ("dense", "tree")

TREE_COST_ON_FLAT = 2.5
"""How many times the flat pass's cost per FLOP a tree's pass costs where the rows would otherwise run flat (CUDA):
HF's forward with FlexAttention against ctxrl's flat decoder, measured on one H200 with ``benchmarks/shared_prefix.py
--device cuda`` (docs/performance.md): 3.06x fewer FLOPs ran 0.99x as fast at 0.5B and 3.08x fewer 1.50x as fast
at 1.5B, i.e. 2-3x. With it a tree is shared only where it saves more than that, so ``auto`` is not slower than
``off`` on the measured workloads."""
"""How a packed tree's attention is computed (module docstring)."""


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP estimate needs of a decoder."""

    name: str
    matmul_params: int
    """Parameters a token's forward pass multiplies by: all but an input embedding that is not the output head."""
    layers: int
    attention_width: int
    """Query heads x head dim."""

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelShape:
        """From a Llama-layout HF config (Llama, Qwen2, Mistral): an object or a dict. Qwen2 has q/k/v biases; Llama
        has them when ``attention_bias``."""
        get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
        hidden, inter, layers = get("hidden_size"), get("intermediate_size"), get("num_hidden_layers")
        heads = get("num_attention_heads")
        kv_heads = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or hidden // heads
        vocab = get("vocab_size")  # the head multiplies; an untied input embedding is a lookup
        bias = bool(get("attention_bias", get("model_type") == "qwen2"))
        q, kv = heads * head_dim, kv_heads * head_dim
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden + (q + 2 * kv) * bias
        body = layers * per_layer + hidden  # + the final norm
        return cls(name or str(get("model_type", "")), body + vocab * hidden, layers, q)


@dataclass(frozen=True)
class Cost:
    """Tokens, attention pairs and estimated training FLOPs (forward + backward) of a way to run rows."""

    tokens: int
    attention_pairs: int
    flops: float


def training_flops(shape: ModelShape, tokens: int, attention_pairs: int) -> float:
    """``6 N tokens + 12 layers W pairs`` (module docstring)."""
    return 6.0 * shape.matmul_params * tokens + 12.0 * shape.layers * shape.attention_width * attention_pairs


def unshared_cost(shape: ModelShape, lengths: Sequence[int]) -> Cost:
    """Each row alone, causal attention (the flat pass)."""
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return Cost(tokens, pairs, training_flops(shape, tokens, pairs))


def shared_cost(shape: ModelShape, tree: PrefixTree, kernel: str = "dense") -> Cost:
    """The packed tree under ``kernel``: ``dense`` scores all ``L^2`` pairs, ``tree`` only each token's ancestors
    and itself."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    pairs = len(tree) ** 2 if kernel == "dense" else sum(d + 1 for d in tree.depth)
    return Cost(len(tree), pairs, training_flops(shape, len(tree), pairs))


@dataclass(frozen=True)
class SharingPlan:
    """Whether to pack a tree, why, and what either way costs."""

    share: bool
    reason: str
    rows: int
    unshared: Cost
    shared: Cost
    tree: PrefixTree | None = field(default=None, compare=False, repr=False)
    """The tree the plan weighed, for the caller that packs it (``pack_tree(..., tree=plan.tree)``)."""

    @property
    def saved_tokens(self) -> int:
        return self.unshared.tokens - self.shared.tokens

    @property
    def flop_ratio(self) -> float:
        """Unshared FLOPs over shared ones (above 1: sharing is cheaper)."""
        return self.unshared.flops / self.shared.flops if self.shared.flops else 1.0


def plan_sharing(tree: PrefixTree, shape: ModelShape, *, min_shared_tokens: int = 32, min_rows: int = 2,
                 kernel: str = "dense", cost_factor: float = 1.0) -> SharingPlan:
    """Share ``tree``'s prefixes when it has at least ``min_rows`` rows, saves at least ``min_shared_tokens``
    tokens, and costs fewer estimated FLOPs under ``kernel`` than its rows alone (module docstring), its FLOPs
    weighed ``cost_factor`` times theirs (a tree's pass slower per FLOP than the rows' own: ``TREE_COST_ON_FLAT``)."""
    _check(min_shared_tokens, min_rows, kernel, cost_factor)
    rows = len(tree.row_nodes)
    unshared = unshared_cost(shape, [len(nodes) for nodes in tree.row_nodes])
    shared = shared_cost(shape, tree, kernel)
    saved = unshared.tokens - shared.tokens
    if rows < min_rows:
        share, reason = False, f"{rows} row(s), fewer than {min_rows}"
    elif saved < min_shared_tokens:
        share, reason = False, f"saves {saved} tokens, fewer than {min_shared_tokens}"
    elif shared.flops * cost_factor >= unshared.flops:
        share, reason = False, (f"the {kernel} tree's attention ({shared.attention_pairs} pairs) costs more than the "
                                f"{saved} shared tokens save" if cost_factor == 1.0 else
                                f"saves {unshared.flops / shared.flops:.2f}x FLOPs, less than the tree's pass costs "
                                f"per FLOP ({cost_factor:g}x)")
    else:
        share, reason = True, f"saves {saved} of {unshared.tokens} tokens, {unshared.flops / shared.flops:.2f}x FLOPs"
    return SharingPlan(share, reason, rows, unshared, shared, tree)


def _check(min_shared_tokens: int, min_rows: int, kernel: str, cost_factor: float = 1.0) -> None:
    if not cost_factor >= 1.0:
        raise ValueError(f"cost_factor must be >= 1 (a tree's FLOPs weighed against its rows'), got {cost_factor}")
    if min_rows < 2:
        raise ValueError(f"min_rows must be >= 2 (one row shares nothing), got {min_rows}")
    if min_shared_tokens < 1:
        raise ValueError(f"min_shared_tokens must be >= 1, got {min_shared_tokens}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")


def plan_batch(rows: Sequence, shape: ModelShape, *, min_shared_tokens: int = 32, min_rows: int = 2,
               max_tokens: int = 0, kernel: str = "dense",
               cost_factor: float = 1.0) -> list[tuple[list[int], SharingPlan]]:
    """A batch's rows cut into trees, and each tree's plan, in the order of the trees' first rows.

    In sorted order (``sorted_rows``) a run of rows stays one tree when sharing it whole pays (``plan_sharing``'s
    rules), its weakest link (the least prefix neighbours share) is at least ``min_shared_tokens``, it holds at
    most ``max_tokens`` tokens (0: no cap), and its two halves, cut at that link (the middlemost of equal ones),
    cost no fewer FLOPs, each run its own best way; otherwise it is those halves, cut the same way. So rows that
    share only a system prompt part there when a dense mask over both of their subtrees costs more than the prompt
    saves, and a group stays whole when its prompt pays for it. A run's costs come from the links alone: a row adds
    its tokens past its link. ``cost_factor``: a shared tree's FLOPs are weighed that many times its rows' own.
    """
    _check(min_shared_tokens, min_rows, kernel, cost_factor)
    order, links = sorted_rows(rows)
    lengths = [len(as_ids(rows[r], f"row {r}")) for r in order]

    def cost(start: int, stop: int) -> tuple[float, bool]:
        """The run's FLOPs as its plan would run it, and whether that is shared."""
        n, new = lengths[start:stop], [lengths[start]] + [lengths[i] - links[i] for i in range(start + 1, stop)]
        unshared, packed = unshared_cost(shape, n), sum(new)
        pairs = packed**2 if kernel == "dense" else sum(k * (k + 1) // 2 - (k - m) * (k - m + 1) // 2
                                                         for k, m in zip(n, new))
        shared = training_flops(shape, packed, pairs) * cost_factor
        pays = stop - start >= min_rows and unshared.tokens - packed >= min_shared_tokens and shared < unshared.flops
        return (shared, True) if pays else (unshared.flops, False)

    def cut(start: int, stop: int) -> tuple[list[tuple[int, int]], float]:
        """The run's trees and their FLOPs: whole if shared whole pays and beats its halves' best, else the halves'."""
        whole, pays = cost(start, stop)
        if stop - start == 1:
            return [(start, stop)], whole
        weakest = min(links[start + 1:stop])
        middle = (start + stop) / 2
        at = min((i for i in range(start + 1, stop) if links[i] == weakest), key=lambda i: abs(i - middle))
        left, left_cost = cut(start, at)
        right, right_cost = cut(at, stop)
        tokens = lengths[start] + sum(lengths[i] - links[i] for i in range(start + 1, stop))
        if pays and weakest >= min_shared_tokens and (max_tokens <= 0 or tokens <= max_tokens) and \
                whole <= left_cost + right_cost:
            return [(start, stop)], whole
        return left + right, left_cost + right_cost

    runs, _ = cut(0, len(order)) if order else ([], 0.0)
    out = []
    for start, stop in runs:
        group = sorted(order[start:stop])
        tree = build_tree([rows[r] for r in group])
        out.append((group, plan_sharing(tree, shape, min_shared_tokens=min_shared_tokens, min_rows=min_rows,
                                        kernel=kernel, cost_factor=cost_factor)))
    return sorted(out, key=lambda pair: pair[0][0])
