"""The tree's FlexAttention kernel (``ctxrl.learner.shared_prefix.flex``): on the CPU, where FlexAttention has a
forward pass only, its log-probs through the real model equal the dense mask's in float64; the pack, the kernel's
registration and the choice of kernel by device. The gradients and the speed are the card's to show
(``benchmarks/shared_prefix.py --device cuda --check``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_shared_prefix import _group, _padded, _segments, _trial

from ctxrl.learner.logprobs import token_logprobs, tree_token_logprobs
from ctxrl.learner.shared_prefix import pack_tree
from ctxrl.learner.shared_prefix.flex import KERNEL, available, flex_tree, tree_block_mask
from ctxrl.learner.shared_prefix.layout import tree_logprobs

pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # (flex_attention warns that it runs unfused without torch.compile)
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("workload", [_group, _trial, _segments])
def test_flex_log_probs_equal_the_dense_masks_and_the_padded_rows(model, workload):
    g = torch.Generator().manual_seed(3)
    rows, masks = workload(model.config.vocab_size, g)
    m = copy.deepcopy(model).double()
    ids, attention, lengths = _padded(rows)
    live = torch.arange(ids.shape[1] - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    with torch.no_grad():
        padded = token_logprobs(m, ids, attention)
        dense = pack_tree(rows, masks, dtype=torch.float64)
        flex = pack_tree(rows, masks, dtype=torch.float64, kernel="flex")
        by_dense = dense.unpack(tree_logprobs(m, dense, only_wanted=False))
        by_flex = flex.unpack(tree_logprobs(m, flex, only_wanted=False))
        chunked = flex.unpack(tree_token_logprobs(m, flex, chunk=7))  # the learner's pass: the chunked head
    assert torch.allclose(by_flex[live], by_dense[live], rtol=0, atol=1e-10)
    assert torch.allclose(by_flex[live], padded[live], rtol=0, atol=1e-10)
    wanted = flex.unpack(flex.wanted.double()).bool()
    assert wanted.any() and torch.allclose(chunked[wanted], padded[wanted], rtol=0, atol=1e-10)
    assert m.config._attn_implementation != KERNEL  # the model's own attention again after the pass


def test_a_flex_pack_has_no_dense_mask_and_its_block_mask_is_the_ancestor_rule():
    rows = [[5, 6, 7, 8], [5, 6, 9], [5, 10]]
    flex, dense = pack_tree(rows, kernel="flex"), pack_tree(rows)
    assert flex.attention_mask is None and flex.kernel == "flex" and dense.kernel == "dense"
    assert torch.equal(flex.size, dense.size) and torch.equal(flex.parent, dense.parent)
    block = tree_block_mask(flex.size)
    n = flex.size.shape[0]
    q, k = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    allowed = block.mask_mod(torch.tensor(0), torch.tensor(0), q, k)
    assert torch.equal(allowed, dense.attention_mask[0, 0] == 0)
    with pytest.raises(ValueError, match="kernel must be one of dense, flex"):
        pack_tree(rows, kernel="sparse")


def test_the_kernel_is_swapped_in_for_one_pass_and_back_after_an_error(model):
    m = copy.deepcopy(model)
    before = m.config._attn_implementation
    with pytest.raises(RuntimeError, match="inside"):
        with flex_tree(m):
            assert m.config._attn_implementation == KERNEL
            raise RuntimeError("inside")
    assert m.config._attn_implementation == before


def test_trees_run_dense_off_cuda_and_flex_on_it(model):
    from ctxrl.learner.forward import choose
    from ctxrl.sections import TrainConfig

    assert not available("cpu")
    assert choose(model, TrainConfig(shared_prefix="auto"), "policy").tree_kernel == "dense"
    assert available("cuda") and available(torch.device("cuda", 1))  # (by the device's type: trees on a card)


def test_a_model_that_trains_with_attention_dropout_keeps_the_dense_mask(model, monkeypatch):
    """FlexAttention's path applies no dropout, so such a model's trees keep SDPA's dense mask even on a card."""
    import ctxrl.learner.forward as forward

    monkeypatch.setattr(forward, "flex_available", lambda device: True)  # (as on a card)
    m = copy.deepcopy(model)
    assert forward.tree_kernel(m) == "flex"
    m.config.attention_dropout = 0.1
    assert forward.tree_kernel(m) == "dense"
