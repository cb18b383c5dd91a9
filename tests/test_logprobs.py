"""Chunked log-probs and entropy equal the full-logits computation, values and gradients; packing by tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from ctxrl.train.batch import collate, pack
from ctxrl.train.learner import Learner, PPOSettings
from ctxrl.train.logprobs import token_logprobs
from ctxrl.types import Episode, Task


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [14, 30, 9, 22], [4, 10, 3, 21]
    rows = []
    for n, p in zip(lengths, prompts):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        mask = [0] * p + [1] * (n - p)
        rows.append(Episode(task=Task(id="t", prompt="p", answer="a"), input_ids=ids, loss_mask=mask,
                            behavior_logprobs=[0.0] * n, turn_index=[0] * n))
    return collate(rows, 0)


def _loss_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, mask=batch.loss_mask, with_entropy=True,
                             entropy_grad=True, temperature=0.7, **kwargs)
    # a loss that weighs every position differently, so a misplaced value would change the gradient
    weights = torch.linspace(0.5, 1.5, lp.numel()).reshape(lp.shape)
    loss = (lp * weights * batch.loss_mask).sum() + 0.3 * (ent * batch.loss_mask).sum()
    loss.backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 5, 64, 4096])
def test_chunked_logprobs_entropy_and_gradients_equal_the_full_computation(model, tokenizer, chunk):
    """In float64 the two agree to 1e-10 (the same maths); in float32 to rounding (sums taken in another order)."""
    batch = _batch(len(tokenizer))
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        policy = copy.deepcopy(model).to(dtype).train()
        full_lp, full_ent, full_grads = _loss_and_grads(policy, batch, chunk=0)
        lp, ent, grads = _loss_and_grads(policy, batch, chunk=chunk)
        torch.testing.assert_close(lp, full_lp, atol=tolerance, rtol=0)
        torch.testing.assert_close(ent, full_ent, atol=tolerance, rtol=0)
        assert set(grads) == set(full_grads) and len(grads) == len(list(policy.parameters()))
        for name, g in full_grads.items():
            assert float((grads[name] - g).abs().max()) <= tolerance * max(1.0, float(g.abs().max())), name
        # outside the mask: 0, and nothing was computed for them
        assert float(lp[batch.loss_mask == 0].abs().sum()) == 0.0


def test_chunked_logprobs_without_a_mask_cover_every_position(model, tokenizer):
    batch = _batch(len(tokenizer), seed=3)
    with torch.no_grad():
        full = token_logprobs(model, batch.input_ids, batch.attention_mask)
        chunked = token_logprobs(model, batch.input_ids, batch.attention_mask, chunk=7)
    live = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(chunked[live], full[live], atol=1e-5, rtol=1e-5)


def test_a_model_whose_logits_are_not_a_linear_head_falls_back_to_full_logits(model, tokenizer):
    """Logit soft-capping (Gemma 2) breaks head(hidden) == logits: detected, warned, computed correctly."""
    policy = copy.deepcopy(model)
    forward = policy.forward

    def capped(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = 0.5 * torch.tanh(out.logits / 0.5)
        return out

    policy.forward = capped
    batch = _batch(len(tokenizer), seed=1)
    with torch.no_grad(), pytest.warns(UserWarning, match="not a linear head"):
        chunked = token_logprobs(policy, batch.input_ids, batch.attention_mask, mask=batch.loss_mask, chunk=8)
    with torch.no_grad():
        full = token_logprobs(policy, batch.input_ids, batch.attention_mask, mask=batch.loss_mask)
    torch.testing.assert_close(chunked, full)


def test_pack_by_rows_is_consecutive():
    assert pack([5, 3, 9, 1, 2], 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        pack([1], 0)


def test_pack_by_tokens_keeps_every_micro_batch_within_the_budget():
    lengths = [12, 31, 7, 45, 20, 9, 26, 16, 100]
    groups = pack(lengths, max_rows=3, max_tokens=64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row once
    for g in groups:
        assert len(g) <= 3
        longest = max(lengths[i] for i in g)
        assert len(g) * longest <= 64 or len(g) == 1  # a row over budget goes alone
    assert [8] in groups  # the 100-token row
    # longest first: 100 alone, 45 alone (2 x 45 > 64), 31 + 26 (2 x 31 = 62), 20 + 16 + 12 (3 x 20 = 60),
    # then three rows is the limit: 9 + 7
    assert groups == [[8], [3], [1, 6], [4, 7, 0], [5, 2]]


def test_token_budget_micro_batches_give_the_same_gradient(model, tokenizer):
    g = torch.Generator().manual_seed(2)
    rows = []
    for n, p in zip([12, 31, 7, 45, 20, 9], [5, 10, 3, 20, 20, 4]):
        ids = torch.randint(3, len(tokenizer), (n,), generator=g).tolist()
        rows.append(Episode(task=Task(id="t", prompt="p", answer="a"), input_ids=ids, loss_mask=[0] * p + [1] * (n - p),
                            behavior_logprobs=[0.0] * p + [-2.0] * (n - p), turn_index=[0] * n))
    batch = collate(rows, 0, advantages=[1.0, -0.5, 0.3, 2.0, 0.0, -1.0])
    policy = copy.deepcopy(model).train()
    grads = {}
    for budget in (0, 60):
        settings = PPOSettings(micro_batch_size=8, max_tokens_per_microbatch=budget)
        learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0), settings, pad_token_id=0)
        policy.zero_grad(set_to_none=True)
        metrics = learner.mini_batch_loss(batch)
        grads[budget] = (metrics["loss"], {n: p.grad.clone() for n, p in policy.named_parameters()})
    assert grads[0][0] == pytest.approx(grads[60][0], rel=1e-5)
    for name, grad in grads[0][1].items():
        assert float((grads[60][1][name] - grad).abs().max()) <= 2e-5 * max(1.0, float(grad.abs().max())), name


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_path, lora):
    from ctxrl.config import load_config
    from ctxrl.train.policy import Policy

    grads = {}
    for on in (False, True):
        overrides = ["model.device=cpu", f"train.gradient_checkpointing={str(on).lower()}"]
        policy = Policy.load(load_config(None, overrides + (["lora.rank=4"] if lora else [])), "cpu")
        if lora:  # B starts at 0 (no gradient reaches A): give the adapters a value first
            torch.manual_seed(0)
            for p in policy.trainable_parameters():
                p.data.normal_(0, 0.02)
        policy.model.train()
        batch = _batch(policy.model.config.vocab_size, seed=5)
        _, _, grads[on] = _loss_and_grads(policy.model, batch, chunk=16)
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, g in grads[False].items():
        assert float((grads[True][name] - g).abs().max()) <= 1e-5 * max(1.0, float(g.abs().max())), name


def test_an_entropy_only_reported_builds_no_graph(model, tokenizer):
    """Without entropy_grad the entropy is a figure: no gradient, so a checkpointed chunk keeps nothing for it."""
    batch = _batch(len(tokenizer))
    for chunk in (0, 8):
        lp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, mask=batch.loss_mask,
                                 with_entropy=True, chunk=chunk)
        assert lp.requires_grad and not ent.requires_grad
        _, graded = token_logprobs(model, batch.input_ids, batch.attention_mask, mask=batch.loss_mask,
                                   with_entropy=True, entropy_grad=True, chunk=chunk)
        assert graded.requires_grad
        torch.testing.assert_close(ent, graded.detach())
