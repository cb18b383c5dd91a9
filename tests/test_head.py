"""The fused output head (``ctxrl.train.head.linear_logprobs``): log-probs, entropies and gradients equal to
autograd's own operations (linear, float32 log-softmax, gather), with a temperature, a bias, a frozen weight,
and in bfloat16 within rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxrl.train.head import linear_logprobs


def _reference(states, weight, bias, targets, temperature):
    logits = F.linear(states, weight, bias)
    x = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    logp = torch.log_softmax(x, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def _inputs(dtype, with_bias: bool, seed: int = 0, n: int = 7, hidden: int = 6, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(n, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    bias = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    return states, weight, bias, targets, upstream


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_logprobs_entropy_and_gradients_equal_autograd_in_float64(temperature, with_bias):
    states, weight, bias, targets, upstream = _inputs(torch.float64, with_bias)
    leaves = [t for t in (states, weight, bias) if t is not None]
    want_lp, want_ent = _reference(states, weight, bias, targets, temperature)
    want_grads = torch.autograd.grad((want_lp * upstream).sum(), leaves)
    got_lp, got_ent = linear_logprobs(states, weight, bias, targets, temperature, with_entropy=True)
    got_grads = torch.autograd.grad((got_lp * upstream).sum(), leaves)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-12, rtol=1e-12)
    assert not got_ent.requires_grad  # a figure, never part of the graph
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_gradcheck_of_the_hand_written_backward():
    states, weight, bias, targets, _ = _inputs(torch.float64, True, seed=3, n=4, hidden=3, vocab=5)
    assert torch.autograd.gradcheck(lambda s, w, b: linear_logprobs(s, w, b, targets, 0.9)[0], (states, weight, bias))


def test_a_frozen_weight_gets_no_gradient_and_the_states_still_do():
    states, weight, _, targets, upstream = _inputs(torch.float64, False, seed=1)
    weight = weight.detach()
    lp, ent = linear_logprobs(states, weight, None, targets)
    assert torch.count_nonzero(ent) == 0  # no entropy asked for
    (lp * upstream).sum().backward()
    assert weight.grad is None and states.grad is not None and states.grad.abs().sum() > 0


def test_bfloat16_is_the_unfused_computation_up_to_rounding():
    states, weight, bias, targets, upstream = _inputs(torch.bfloat16, True, seed=2, n=16, hidden=32, vocab=300)
    want_lp, _ = _reference(states, weight, bias, targets, 1.0)
    want_grads = torch.autograd.grad((want_lp * upstream).sum(), (states, weight, bias))
    got_lp, _ = linear_logprobs(states, weight, bias, targets)
    got_grads = torch.autograd.grad((got_lp * upstream).sum(), (states, weight, bias))
    assert got_lp.dtype == torch.float32
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)  # the same float32 maths on the same logits
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
