"""Shared-prefix (tree) training: the trie, the packed layout and plan by hand, and the tree-packed log-probs and
gradients equal to the padded forward pass's in float64 (``ctxrl.learner.shared_prefix``)."""

from __future__ import annotations

import copy

import pytest
import torch

from ctxrl.learner.logprobs import token_logprobs
from ctxrl.learner.shared_prefix import ModelShape, build_tree, pack_tree, plan_batch, plan_sharing, sorted_rows
from ctxrl.learner.shared_prefix.layout import tree_logprobs
from ctxrl.learner.shared_prefix.plan import shared_cost, training_flops, unshared_cost

# -- the trie, by hand ------------------------------------------------------------------------------


def test_tree_of_three_rows_by_hand():
    # 1-2-{3-{4, 6-7}, 5}: pre-order with children in the order rows reach them
    tree = build_tree([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]])
    assert tree.ids == [1, 2, 3, 4, 6, 7, 5]
    assert tree.parent == [-1, 0, 1, 2, 2, 4, 1]
    assert tree.depth == [0, 1, 2, 3, 3, 4, 2]
    assert tree.size == [7, 6, 4, 1, 2, 1, 1]
    assert tree.row_nodes == [[0, 1, 2, 3], [0, 1, 6], [0, 1, 2, 4, 5]]
    assert (tree.row_tokens, len(tree), tree.saved_tokens) == (12, 7, 5)


@pytest.mark.parametrize("rows, ids, parent, row_nodes", [
    ([[5, 6, 7]], [5, 6, 7], [-1, 0, 1], [[0, 1, 2]]),  # one row
    ([[5, 6, 7], [5, 6, 7]], [5, 6, 7], [-1, 0, 1], [[0, 1, 2], [0, 1, 2]]),  # identical rows
    ([[1, 2], [3, 4]], [1, 2, 3, 4], [-1, 0, -1, 2], [[0, 1], [2, 3]]),  # no sharing: two roots
    ([[1, 2], [1, 2, 3]], [1, 2, 3], [-1, 0, 1], [[0, 1], [0, 1, 2]]),  # a prefix that is a whole row
    ([[1, 2, 3], [1, 2]], [1, 2, 3], [-1, 0, 1], [[0, 1, 2], [0, 1]]),  # ... listed after the longer row
    ([[9], [9, 8]], [9, 8], [-1, 0], [[0], [0, 1]]),  # a one-token row (no log-prob of its own)
])
def test_tree_edge_cases(rows, ids, parent, row_nodes):
    tree = build_tree(rows)
    assert (tree.ids, tree.parent, tree.row_nodes) == (ids, parent, row_nodes)


def test_tensor_rows_build_the_same_tree_as_lists():
    rows = [[1, 2, 3, 4], [1, 2, 5]]
    assert build_tree([torch.tensor(r) for r in rows]) == build_tree(rows)


def test_sorted_rows_and_their_links_by_hand():
    system = [1, 1, 1]
    rows = [system + [2, 2, 2, 7], system + [3, 3, 3, 8], system + [2, 2, 2, 9], [4, 4], system + [3, 3, 3, 6, 6]]
    order, links = sorted_rows(rows)
    assert order == [0, 2, 4, 1, 3]
    assert links == [0, 6, 3, 6, 0]  # the groups' prompts (6 tokens), the system prompt between them (3), nothing
    assert sorted_rows([[5], [5]]) == ([0, 1], [0, 1])


# -- the packed layout, by hand ---------------------------------------------------------------------


def test_packed_positions_mask_and_unpack_by_hand():
    packed = pack_tree([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]], dtype=torch.float64)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 6, 7, 5]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 2]]  # each branch restarts after its parent
    allowed = (packed.attention_mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0, 0],
                       [1, 1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 1, 0, 0, 0],  # 4 sees 1 2 3
                       [1, 1, 1, 0, 1, 0, 0],  # 6 sees 1 2 3, not its sibling 4
                       [1, 1, 1, 0, 1, 1, 0],
                       [1, 1, 0, 0, 0, 0, 1]]  # 5 sees only the shared 1 2
    assert packed.attention_mask.dtype == torch.float64
    assert packed.lengths.tolist() == [4, 3, 5]
    # the boundary: token 5 of row 1 (node 6) is scored at node 1 (token 2), not at its packed neighbour (node 5)
    assert packed.parent.tolist() == [-1, 0, 1, 2, 2, 4, 1]
    values = torch.arange(7, dtype=torch.float64) * 10  # one value per node
    assert packed.unpack(values).tolist() == [[10, 20, 30, 0], [10, 60, 0, 0], [10, 20, 40, 50]]


def test_wanted_is_any_row_loss_mask_at_its_nodes():
    rows = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]]
    masks = [[0, 0, 1, 1], [0, 0, 1], [0, 0, 0, 1, 0]]  # node 2 (token 3) wanted by row 0 only
    packed = pack_tree(rows, masks)
    assert packed.wanted.tolist() == [False, False, True, True, True, False, True]
    everything = pack_tree(rows)
    assert everything.wanted.tolist() == [False] + [True] * 6  # a first token has no log-prob
    assert pack_tree(rows, [[1, 0, 0, 0], [1, 0, 0], [1, 0, 0, 0, 0]]).wanted.tolist() == [False] * 7


@pytest.mark.parametrize("rows, masks, match", [
    ([[1, 2, 3]], [[0, 1]], "row 0 has 3 tokens but a loss mask of shape"),
    ([[1, 2, 3], [1, 2]], [[0, 1, 1]], "1 loss masks for 2 rows"),
    ([[1, 2, 3]], [[0, 2, 1]], "values other than 0 and 1"),
    ([[1, 2, 3]], [[[0, 1, 1]]], "loss mask of shape"),
    ([[1, 2], []], None, "row 1 has no tokens"),
    ([[1, 2], [1, -3]], None, "row 1 holds -3"),
    ([[1, 2], [1, 2.5]], None, "row 1 holds 2.5"),
    ([torch.tensor([[1, 2]])], None, "2D tensor"),
    ([torch.tensor([1.0, 2.0])], None, "torch.float32"),
    ([], None, "no rows"),
])
def test_bad_input_is_a_clear_error(rows, masks, match):
    with pytest.raises(ValueError, match=match):
        pack_tree(rows, masks)


def test_unpack_refuses_values_that_are_not_one_per_node():
    packed = pack_tree([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match="one per node"):
        packed.unpack(torch.zeros(3, 2))


def test_bad_plan_settings_are_clear_errors():
    tree, shape = build_tree([[1, 2], [1, 3]]), ModelShape("toy", 10, 1, 1)
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        plan_sharing(tree, shape, kernel="flash")
    with pytest.raises(ValueError, match="min_rows must be >= 2"):
        plan_sharing(tree, shape, min_rows=1)
    with pytest.raises(ValueError, match="min_shared_tokens must be >= 1"):
        plan_batch([[1]], shape, min_shared_tokens=0)


# -- the plan and the FLOP estimate, by hand --------------------------------------------------------


def test_flops_and_plan_by_hand():
    shape = ModelShape("toy", matmul_params=10, layers=2, attention_width=3)  # 60 per token, 72 per pair
    assert training_flops(shape, tokens=5, attention_pairs=4) == 60 * 5 + 72 * 4
    tree = build_tree([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]])
    unshared = unshared_cost(shape, [4, 3, 5])
    assert (unshared.tokens, unshared.attention_pairs) == (12, 10 + 6 + 15)
    dense, ideal = shared_cost(shape, tree, "dense"), shared_cost(shape, tree, "tree")
    assert (dense.tokens, dense.attention_pairs) == (7, 49)
    assert (ideal.tokens, ideal.attention_pairs) == (7, 1 + 2 + 3 + 4 + 4 + 5 + 3)  # depth + 1 per node
    # dense: 7*60 + 49*72 = 3948 > unshared 12*60 + 31*72 = 2952: the mask costs more than 5 tokens save
    plan = plan_sharing(tree, shape, min_shared_tokens=5)
    assert not plan.share and "costs more" in plan.reason and plan.saved_tokens == 5
    plan = plan_sharing(tree, shape, min_shared_tokens=5, kernel="tree")  # 7*60 + 22*72 = 2004
    assert plan.share and plan.flop_ratio == pytest.approx(2952 / 2004)
    assert not plan_sharing(tree, shape, min_shared_tokens=6, kernel="tree").share  # saves 5 < 6
    assert "1 row(s)" in plan_sharing(build_tree([[1, 2, 3]]), shape, min_shared_tokens=1).reason


def test_a_tree_whose_pass_costs_more_per_flop_must_save_that_much_more():
    """``cost_factor``: the tree of ``test_flops_and_plan_by_hand`` saves 2952 / 2004 = 1.47x FLOPs under the tree
    kernel; weighed 1.4 times its rows' own it still pays, weighed 1.5 times it does not, and the plan says why."""
    shape = ModelShape("toy", matmul_params=10, layers=2, attention_width=3)
    rows = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]]
    tree = build_tree(rows)
    assert plan_sharing(tree, shape, min_shared_tokens=5, kernel="tree", cost_factor=1.4).share
    plan = plan_sharing(tree, shape, min_shared_tokens=5, kernel="tree", cost_factor=1.5)
    assert not plan.share and plan.reason == "saves 1.47x FLOPs, less than the tree's pass costs per FLOP (1.5x)"
    # (plan_batch's min_shared_tokens bounds the weakest link, 2 here; the whole tree beats its halves at 1.4)
    assert [p.share for _, p in plan_batch(rows, shape, min_shared_tokens=2, kernel="tree", cost_factor=1.4)] == [True]
    assert not any(p.share for _, p in plan_batch(rows, shape, min_shared_tokens=2, kernel="tree", cost_factor=1.5))
    with pytest.raises(ValueError, match="cost_factor must be >= 1"):
        plan_batch(rows, shape, cost_factor=0.5)


def test_trees_are_weighed_against_the_flat_pass_only_where_the_rows_would_run_flat(model, monkeypatch):
    """On the CPU the rows run padded through the same HF pass as a tree: factor 1. With a flat decoder for the
    rest (CUDA), the plan is asked for ``TREE_COST_ON_FLAT``."""
    import ctxrl.learner.forward as forward
    from ctxrl.learner.batch import collate
    from ctxrl.learner.shared_prefix.plan import TREE_COST_ON_FLAT
    from ctxrl.sections import TrainConfig
    from ctxrl.types import TrainSequence

    seen = []

    def spy(*args, cost_factor, **kwargs):
        seen.append(cost_factor)
        return iter(())

    monkeypatch.setattr(forward, "tree_micro_batches", spy)
    batch = collate([TrainSequence(input_ids=[5, 6, 7], loss_mask=[0, 1, 1], behavior_logprobs=[0.0] * 3,
                                   advantages=[0.0] * 3)], 0)
    layout = forward.choose(model, TrainConfig(shared_prefix="auto"), "policy")
    list(forward.Forward(model, layout).micro_batches(batch, 4, "cpu"))
    list(forward.Forward(model, forward.Layout(object(), tree=layout.tree)).micro_batches(batch, 4, "cpu"))
    assert seen == [1.0, TREE_COST_ON_FLAT] and TREE_COST_ON_FLAT > 1


def test_a_group_of_long_shared_prompts_pays_even_with_the_dense_mask():
    shape = ModelShape("toy", matmul_params=1000, layers=1, attention_width=1)
    prompt = list(range(1, 201))
    rows = [prompt + [300 + i] * 10 for i in range(8)]
    [(group, plan)] = plan_batch(rows, shape, min_shared_tokens=32)
    assert group == list(range(8)) and plan.share
    assert (plan.unshared.tokens, plan.shared.tokens, plan.saved_tokens) == (1680, 280, 1400)


GROUPS = [[1, 1, 1, 2, 2, 2, 7], [1, 1, 1, 2, 2, 2, 9],  # group A: system prompt, its prompt, one token each
          [1, 1, 1, 3, 3, 3, 6, 6], [1, 1, 1, 3, 3, 3, 8],  # group B
          [4, 4]]  # a row sharing nothing


@pytest.mark.parametrize("params, kernel, expected", [
    # flops / 6P = tokens + w pairs with w = 2W/P. A: 8 packed tokens (64 dense pairs) vs 14 (56 causal pairs);
    # B: 9 (81) vs 15 (64); A and B: 14 (196) vs 29 (120)
    (1000, "dense", [([0, 1, 2, 3], True), ([4], False)]),  # w = 0.01: whole 15.96 < A 8.64 + B 9.81
    (100, "dense", [([0, 1], True), ([2, 3], True), ([4], False)]),  # w = 0.1: whole 33.6 > A 14.4 + B 17.1
    (20, "dense", [([0, 1], True), ([2], False), ([3], False), ([4], False)]),  # w = 0.5: B 49.5 > 15 + 32
    (20, "tree", [([0, 1, 2, 3], True), ([4], False)]),  # only attended pairs: sharing never costs attention
])
def test_plan_batch_cuts_at_the_weakest_link_where_the_halves_cost_less(params, kernel, expected):
    shape = ModelShape("toy", matmul_params=params, layers=1, attention_width=5)
    planned = plan_batch(GROUPS, shape, min_shared_tokens=3, kernel=kernel)
    assert [(group, plan.share) for group, plan in planned] == expected
    for group, plan in planned:  # each tree's figures are the trie's own
        tree = build_tree([GROUPS[r] for r in group])
        assert plan.shared == shared_cost(shape, tree, kernel) and plan.rows == len(group)


def test_plan_batch_keeps_trees_within_the_token_cap():
    shape = ModelShape("toy", matmul_params=1000, layers=1, attention_width=5)
    assert [g for g, _ in plan_batch(GROUPS, shape, min_shared_tokens=3, max_tokens=13)] == [[0, 1], [2, 3], [4]]
    assert [g for g, _ in plan_batch(GROUPS, shape, min_shared_tokens=4)] == [[0, 1], [2, 3], [4]]  # 3 < 4
    assert plan_batch([], shape) == []


def test_model_shape_counts_the_tiny_models_parameters(model):
    shape = ModelShape.from_config(model.config)
    assert shape.matmul_params == sum(p.numel() for p in model.parameters())  # tied: the embedding is the head
    assert shape.layers == model.config.num_hidden_layers
    assert shape.attention_width == model.config.num_attention_heads * model.config.head_dim


# -- equal to the unshared computation, on the tiny model in float64 --------------------------------


def _ids(generator, vocab, n):
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


def _group(vocab, g):
    """A GRPO group: 8 completions of different lengths (two identical, one empty) after one prompt."""
    prompt = _ids(g, vocab, 12)
    completions = [_ids(g, vocab, n) for n in (1, 3, 9, 5, 7, 2)]
    completions += [completions[2], []]  # an identical pair, and a completion of no tokens: the prompt alone
    rows = [prompt + c for c in completions]
    return rows, [[0] * len(prompt) + [1] * len(c) for c in completions]


def _trial(vocab, g):
    """A meta-RL trial of 3 attempts: attempt k's row holds attempts 1..k (prompt, attempt, feedback, ...)."""
    prompt, rows, masks = _ids(g, vocab, 6), [], []
    so_far, mask = list(prompt), [0] * len(prompt)
    for n in (5, 4, 6):
        attempt, feedback = _ids(g, vocab, n), _ids(g, vocab, 2)
        so_far, mask = so_far + attempt, mask + [1] * n
        rows.append(list(so_far))
        masks.append(list(mask))
        so_far, mask = so_far + feedback, [0] * len(mask) + [0] * 2  # an earlier attempt trains in its own row
    return rows, masks


def _segments(vocab, g):
    """Two ``summarize`` episodes of one group: every segment keeps the system + task context, then a summary
    (after the first) and its own turns."""
    context = _ids(g, vocab, 10)
    rows, masks = [], []
    for _episode in range(2):
        for k, n in enumerate((6, 4, 5)):
            summary = _ids(g, vocab, 3) if k else []
            turns = _ids(g, vocab, n)
            rows.append(context + summary + turns)
            masks.append([0] * (len(context) + len(summary)) + [1] * n)
    return rows, masks


def _padded(rows):
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.zeros((len(rows), int(lengths.max())), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
    attention = (torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids, attention, lengths


def _shifted_masks(masks, width):
    out = torch.zeros((len(masks), width - 1), dtype=torch.float64)
    for r, mask in enumerate(masks):
        out[r, : len(mask) - 1] = torch.tensor(mask[1:], dtype=torch.float64)
    return out


class _Float64RMSNorm(torch.nn.Module):
    """HF's ``LlamaRMSNorm`` with its arithmetic in the input's dtype. HF's computes in float32 whatever the model's
    dtype, so in a float64 model its backward rounds each gradient it passes to float32: a prefix's gradient summed
    over its branches before that rounding (the tree) and after it (rows alone) then differ by float32's precision,
    not ours. Swapped in on the test's copy only, keeping the weight (and its name)."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _with_float64_norms(m):
    for name, module in list(m.named_modules()):
        if type(module).__name__.endswith("RMSNorm"):
            parent, _, attribute = name.rpartition(".")
            setattr(m.get_submodule(parent), attribute, _Float64RMSNorm(module))
    return m


def _compare(model, rows, masks, g, *, float64_norms: bool):
    """Per-token log-probs and every parameter's gradient of a masked loss (log-probs x random advantages), padded
    and tree-packed: ``(padded, tree)`` of ``(all log-probs, loss log-probs, grads)``, and the live positions."""
    ids, attention, lengths = _padded(rows)
    loss_mask = _shifted_masks(masks, ids.shape[1])
    advantages = torch.randn(loss_mask.shape, generator=g, dtype=torch.float64)
    live = torch.arange(ids.shape[1] - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    tree = build_tree(rows)
    assert tree.saved_tokens > 0
    results = []
    for shared in (False, True):
        m = copy.deepcopy(model).double().train()
        if float64_norms:
            _with_float64_norms(m)
        if shared:
            packed = pack_tree(rows, masks, dtype=torch.float64, tree=tree)
            everything = packed.unpack(tree_logprobs(m, packed, only_wanted=False))  # every position, for the check
            logprobs = packed.unpack(tree_logprobs(m, packed))  # what a loss would use: the wanted nodes only
        else:
            everything = logprobs = token_logprobs(m, ids, attention)
        loss = -(logprobs * advantages * loss_mask).sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}
        assert len(grads) == len(list(model.parameters()))
        results.append((everything.detach() * live, logprobs.detach() * loss_mask, grads))
    return results, live, loss_mask


@pytest.mark.parametrize("workload", [_group, _trial, _segments])
def test_tree_packed_logprobs_and_gradients_equal_the_padded_forward(model, workload):
    g = torch.Generator().manual_seed(1)
    rows, masks = workload(model.config.vocab_size, g)
    [(all_a, lp_a, g_a), (all_b, lp_b, g_b)], live, loss_mask = _compare(model, rows, masks, g, float64_norms=True)
    assert all_b.shape == all_a.shape == loss_mask.shape
    assert torch.allclose(all_a, all_b, rtol=0, atol=1e-10)
    assert torch.allclose(lp_a, lp_b, rtol=0, atol=1e-10)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], rtol=0, atol=1e-10), name
    assert sum(float(g.abs().sum()) for g in g_a.values()) > 0


def test_with_hfs_float32_norms_the_gradients_agree_to_float32_precision(model):
    """The model as HF computes it (its norms in float32, ``_Float64RMSNorm``): log-probs still exact, gradients
    within float32's rounding of the largest."""
    g = torch.Generator().manual_seed(1)
    rows, masks = _trial(model.config.vocab_size, g)
    [(all_a, _, g_a), (all_b, _, g_b)], _, _ = _compare(model, rows, masks, g, float64_norms=False)
    assert torch.allclose(all_a, all_b, rtol=0, atol=1e-10)
    for name in g_a:
        assert float((g_a[name] - g_b[name]).abs().max()) <= 1e-6 * max(float(g_a[name].abs().max()), 1.0), name


def test_several_trees_in_one_pack_stay_apart(model):
    """Two groups with no common token in one packed sequence: each row sees only its own tree."""
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    rows = [[3, *_ids(g, vocab, 5)], [3, *_ids(g, vocab, 4)], [4, *_ids(g, vocab, 6)], [4, *_ids(g, vocab, 2)]]
    ids, attention, lengths = _padded(rows)
    live = torch.arange(ids.shape[1] - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    m = copy.deepcopy(model).double()
    with torch.no_grad():
        padded = token_logprobs(m, ids, attention)
        packed = pack_tree(rows, dtype=torch.float64)
        shared = packed.unpack(tree_logprobs(m, packed))
    assert torch.allclose(padded[live], shared[live], rtol=0, atol=1e-10)


def test_the_benchmark_smoke_runs_every_workload_and_reports_savings(capsys):
    from test_scripts import script

    report = script("benchmarks/shared_prefix.py").main(["--smoke"])
    workloads = {"grpo/train_step", "grpo/fact_hunt", "meta/minesweeper", "summarize/fact_hunt"}
    assert {r["workload"] for r in report["flops"]} == workloads and set(report["cpu"]) == workloads
    for r in report["flops"]:
        assert r["tree_tokens"] < r["tokens"] and r["tree_flops"] < r["flops"], r  # every workload shares something
        assert r["dense_flops"] <= r["flops"], r  # the plan never costs more than the rows alone
    assert all(set(seconds) == {"padded", "tree", "planned"} for seconds in report["cpu"].values())
    assert set(report["learner"]) == {"grpo/train_step", "grpo/fact_hunt"}  # Learner.update, sharing off and auto
    assert all(seconds["off"] > 0 and seconds["auto"] > 0 for seconds in report["learner"].values())
    assert "qwen2.5-1.5b" in capsys.readouterr().out
