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
from ctxrl.train.precision import MasterAdamW, Precision, _accumulate


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


def test_a_backward_pass_that_raises_leaves_its_adds_for_the_next_pass_to_make():
    waiting = Waiting()
    dst = torch.zeros(3)
    y = torch.ones(3, requires_grad=True)

    def hook(param):
        waiting.add(dst, param.grad.to(torch.bfloat16))
        param.grad = None
    y.register_post_accumulate_grad_hook(hook)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom")

    failing = Boom.apply(torch.ones(1, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="boom"):  # (made later, y's nodes run first: its gradient is in)
        (failing + (2 * y).sum()).backward()
    assert len(waiting.pairs) == 1 and torch.equal(dst, torch.zeros(3))
    (3 * y).sum().backward()  # the next pass's end adds both, in order
    assert waiting.pairs == [] and torch.equal(dst, torch.full((3,), 5.0))


def test_a_launch_never_holds_one_destination_twice_nor_more_than_its_tensors():
    a, b, c = torch.zeros(2), torch.zeros(3), torch.zeros(4)
    src = torch.zeros(1, dtype=torch.bfloat16)
    pairs = [(a, src), (b, src), (a, src), (c, src), (b, src)]
    groups = grad_accumulate.launch_groups(pairs)
    assert [[d.numel() for d, _ in g] for g in groups] == [[2, 3], [2, 4, 3]]
    assert [[d.numel() for d, _ in g] for g in grad_accumulate.launch_groups(pairs, max_tensors=2)] == [
        [2, 3], [2, 4], [3]]
    assert grad_accumulate.launch_groups([]) == []


def test_zeroing_the_gradients_in_place_forgets_what_waits():
    model = random_model("qwen2-test", torch.bfloat16, "cpu", seed=0)
    optimizer = Precision("bfloat16").optimizer(model.parameters(), lr=1e-3)
    optimizer._waiting.pairs.append((optimizer.masters[0], torch.ones_like(optimizer.masters[0])))
    optimizer.zero_grad(set_to_none=False)
    assert optimizer._waiting.pairs == []


def test_a_float32_gradient_becomes_a_master_gradient_of_its_own_not_an_alias():
    # (a CUDA graph's float32 weight gradient is a buffer the next replay overwrites)
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]
    optimizer = MasterAdamW(params, lr=1e-3)
    buffer = torch.full((4,), 2.0)
    params[0].grad = buffer
    _accumulate(optimizer.masters[0], optimizer._waiting)(params[0])  # (the hook, called as autograd would)
    assert params[0].grad is None and optimizer.masters[0].grad.data_ptr() != buffer.data_ptr()
    buffer.fill_(7.0)
    assert torch.equal(optimizer.masters[0].grad, torch.full((4,), 2.0))


def test_a_backward_pass_asks_once_for_its_flush_and_asks_again_where_torch_gives_no_pass_id(monkeypatch):
    class Counting(Waiting):  # (each flush asked for runs once, at the pass's end)
        calls = 0

        def flush(self):
            Counting.calls += 1
            super().flush()

    waiting = Counting()
    ys = [torch.ones(2, requires_grad=True) for _ in range(4)]
    dsts = [torch.zeros(2) for _ in ys]
    for y, d in zip(ys, dsts):
        def hook(param, d=d):
            waiting.add(d, param.grad.to(torch.bfloat16))
            param.grad = None
        y.register_post_accumulate_grad_hook(hook)
    sum(y.sum() for y in ys).backward()
    assert Counting.calls == 1 and all(torch.equal(d, torch.ones(2)) for d in dsts)
    monkeypatch.setattr(grad_accumulate, "_graph_task", lambda: None)  # (an older torch: no id to go by)
    sum(y.sum() for y in ys).backward()
    assert Counting.calls == 1 + 4 and all(torch.equal(d, torch.full((2,), 2.0)) for d in dsts)
