"""Adding low-precision gradients into float32 ones together (``ctxrl.train.grad_accumulate``): what waits is added by
the end of the backward pass that produced it, in bounded batches, and the sums are exactly one float32 add each.
The Triton program itself runs only on CUDA (it checks itself there against ``add_`` before first use)."""

from __future__ import annotations

import copy

import pytest
import torch

from ctxrl.models.shapes import random_model
from ctxrl.train import grad_accumulate
from ctxrl.train.grad_accumulate import Adder, Waiting
from ctxrl.train.precision import Precision


def _pairs(sizes, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(n, generator=g) for n in sizes], [(torch.randn(n, generator=g) * 3).to(dtype) for n in sizes])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_off_cuda_each_pair_is_one_float32_add(dtype):
    dsts, srcs = _pairs([1, 7, 4096], dtype)
    want = [d.clone().add_(s) for d, s in zip(dsts, srcs)]
    assert not grad_accumulate.applies(dsts[0], srcs[0])  # (CPU tensors)
    Adder().add_into(dsts, srcs)
    assert all(torch.equal(d, w) for d, w in zip(dsts, want))
    with pytest.raises(ValueError):  # (a list without its partner is a caller's mistake, not a silent half-add)
        Adder().add_into(dsts, srcs[:2])


def test_outside_a_backward_pass_an_add_happens_at_once():
    waiting = Waiting()
    (dst,), (src,) = _pairs([5])
    want = dst.clone().add_(src)
    waiting.add(dst, src)
    assert torch.equal(dst, want) and waiting.pairs == []


def test_within_a_backward_pass_adds_wait_for_its_end_or_for_the_byte_bound(monkeypatch):
    waiting = Waiting()
    dsts = [torch.zeros(4), torch.zeros(4), torch.zeros(4)]
    seen_during: list[int] = []

    x = torch.randn(4, requires_grad=True)
    ys = [torch.randn(4, requires_grad=True) for _ in dsts]
    for y, d in zip(ys, dsts):
        def hook(param, d=d):
            waiting.add(d, param.grad.to(torch.bfloat16))
            seen_during.append(len(waiting.pairs))
            param.grad = None
        y.register_post_accumulate_grad_hook(hook)
    sum((x * y).sum() for y in ys).backward()
    assert seen_during == [1, 2, 3]  # all three waited ...
    assert waiting.pairs == []  # ... and were added when the pass ended
    for d in dsts:
        assert torch.equal(d, x.detach().to(torch.bfloat16).float())
    # a bound of 2 pairs' bytes: the second add flushes both at once, the third waits for the end
    monkeypatch.setattr(Waiting, "FLUSH_BYTES", 2 * 4 * 2)
    seen_during.clear()
    sum((x * y).sum() for y in ys).backward()
    assert seen_during == [1, 0, 1] and waiting.pairs == []
    for d in dsts:
        assert torch.equal(d, 2 * x.detach().to(torch.bfloat16).float())


def test_masters_take_several_micro_batches_as_the_sum_of_their_float32_casts():
    model = random_model("qwen2-test", torch.bfloat16, "cpu", seed=0)
    plain = copy.deepcopy(model)
    optimizer = Precision("bfloat16").optimizer(model.parameters(), lr=1e-3)
    ids = torch.tensor([[5, 9, 12, 40, 7, 3], [8, 2, 33, 4, 4, 19]])
    sums = None
    for scale in (1.0, -2.0, 0.5):
        plain.zero_grad(set_to_none=True)
        (scale * plain(input_ids=ids).logits.float().logsumexp(-1).mean()).backward()
        casts = [p.grad.float() for p in plain.parameters()]
        sums = casts if sums is None else [a + b for a, b in zip(sums, casts)]
        (scale * model(input_ids=ids).logits.float().logsumexp(-1).mean()).backward()
        assert optimizer._waiting.pairs == []  # (nothing left waiting once backward returns)
    for master, want in zip(optimizer.masters, sums):
        assert torch.equal(master.grad, want)
    optimizer.zero_grad()
    assert all(m.grad is None for m in optimizer.masters) and optimizer._waiting.pairs == []
