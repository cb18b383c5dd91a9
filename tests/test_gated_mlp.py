"""The learner's lean MLP (``ctxrl.models.gated_mlp``) and fused q/k/v projection (``fused.qkv_projections``):
the same outputs and gradients as the modules' own path, and what the MLP keeps for its backward pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxrl.models.fused import qkv_projections
from ctxrl.models.gated_mlp import gated_mlp, silu_mul_grads, supports


class MLP(torch.nn.Module):
    def __init__(self, hidden: int, width: int, dtype, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, width, bias=bias, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, width, bias=bias, dtype=dtype)
        self.down_proj = torch.nn.Linear(width, hidden, bias=bias, dtype=dtype)

    def forward(self, h):  # the HF modules' path
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def _grads(mlp, h, fn):
    for p in mlp.parameters():
        p.grad = None
    h = h.detach().requires_grad_()
    out = fn(h)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out.detach(), h.grad, [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
def test_outputs_and_gradients_equal_the_modules_own_path(dtype, tol):
    torch.manual_seed(0)
    mlp = MLP(16, 40, dtype)
    h = torch.randn(11, 16, dtype=dtype)
    want = _grads(mlp, h, mlp)
    got = _grads(mlp, h, lambda x: gated_mlp(mlp, x))
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)  # the same forward ops
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=tol)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_the_backward_steps_are_autograds_to_the_bit_in_bfloat16():
    torch.manual_seed(1)
    gate, up, grad = (torch.randn(7, 24, dtype=torch.bfloat16) for _ in range(3))
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    product = F.silu(g) * u
    product.backward(grad)
    d_gate, d_up, recomputed = silu_mul_grads(gate, up, grad)
    assert torch.equal(d_gate, g.grad) and torch.equal(d_up, u.grad) and torch.equal(recomputed, product.detach())


def _kept_per_token(fn, h) -> int:
    """Values saved for the backward pass that scale with the tokens (parameters and their views left out)."""
    sizes = {}

    def pack(t):
        if t.dim() and t.shape[0] == h.shape[0]:
            sizes[t.untyped_storage().data_ptr()] = t.numel()  # (one storage counted once)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(h.detach().requires_grad_())
    return sum(sizes.values()) // h.shape[0]


def test_the_lean_mlp_keeps_half_of_what_autograd_keeps():
    hidden, width = 8, 32
    mlp = MLP(hidden, width, torch.float32)
    h = torch.randn(5, hidden)
    assert _kept_per_token(mlp, h) == hidden + 4 * width  # h, gate, up, silu(gate), their product
    assert _kept_per_token(lambda x: gated_mlp(mlp, x), h) == hidden + 2 * width


def test_only_plain_bias_free_projections_are_supported():
    assert supports(MLP(4, 8, torch.float32))
    assert not supports(MLP(4, 8, torch.float32, bias=True))


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, q: int, kv: int, bias) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, q, bias=bias[0], dtype=torch.float64)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=bias[1], dtype=torch.float64)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=bias[2], dtype=torch.float64)


@pytest.mark.parametrize("bias", [(True, True, True), (False, False, False), (True, True, False)])
def test_fused_qkv_equals_three_projections_with_their_gradients(bias):
    torch.manual_seed(2)
    attn = Attention(12, 8, 4, bias)
    h = torch.randn(6, 12, dtype=torch.float64)
    results = []
    for fuse in (False, True):
        for p in attn.parameters():
            p.grad = None
        q, k, v = qkv_projections(attn, h, fuse=fuse)
        assert (q.shape, k.shape, v.shape) == ((6, 8), (6, 4), (6, 4))
        (q.sum() + 2 * k.sum() + 3 * (v ** 2).sum()).backward()
        results.append([q.detach(), k.detach(), v.detach(), *[p.grad.clone() for p in attn.parameters()]])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
