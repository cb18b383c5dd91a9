"""A gated SiLU MLP (``down(silu(gate(h)) * up(h))``) whose backward pass keeps less: the learner's flat forward.

Through autograd the MLP keeps, per token, the gate's and the up projection's outputs, the SiLU of the gate
and their product (the down projection's input): ``4 I`` values for an MLP of width ``I``, which is most of a
decoder layer's activations (Qwen2.5-0.5B: 19,456 of 26,112 values per token per layer). ``gated_mlp`` keeps
the two projections' outputs alone (``2 I``) and recomputes the SiLU and the product in the backward pass: two
element-wise passes over ``[tokens, I]``, no matrix product again (checkpointing the whole MLP would redo two
of its three products). The gradients are the same computation as autograd's, in the same dtypes.

The element-wise steps (``silu_mul_grads``) are compiled on CUDA with the other fused steps
(``ctxrl.models.fused``). What this does not do: biases (no Llama-layout MLP has them; ``supports`` says so and
the caller keeps the modules' own path), or anything for LoRA-wrapped projections (the flat forward pass does
not take PEFT models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_grads(gate: torch.Tensor, up: torch.Tensor,
                   grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d gate, d up, silu(gate) * up)`` for the gradient ``grad`` of ``silu(gate) * up``: the ops autograd runs
    for ``F.silu(gate) * up`` (the product's two gradients, then ``silu_backward``), in the same dtypes, so the
    eager result is autograd's to the bit; the forward's product is recomputed the same way."""
    act = F.silu(gate)
    return torch.ops.aten.silu_backward(grad * up, gate), grad * act, act * up


def supports(mlp) -> bool:
    """Whether ``mlp`` (a Llama-layout MLP) runs through ``gated_mlp``: plain linear projections without biases."""
    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return all(type(m) is torch.nn.Linear and m.bias is None for m in layers)


class _GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w_gate, w_up, w_down, grads_fn):
        gate, up = F.linear(h, w_gate), F.linear(h, w_up)
        out = F.linear(F.silu(gate) * up, w_down)
        ctx.save_for_backward(h, gate, up, w_gate, w_up, w_down)
        ctx.grads_fn = grads_fn
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        grad_out = grad_out.reshape(-1, grad_out.shape[-1])
        grad_act = grad_out @ w_down  # [T, I]
        d_gate, d_up, act = ctx.grads_fn(gate.reshape(grad_act.shape), up.reshape(grad_act.shape), grad_act)
        flat_h = h.reshape(-1, h.shape[-1])
        grad_w_down = grad_out.t() @ act if ctx.needs_input_grad[3] else None
        grad_w_gate = d_gate.t() @ flat_h if ctx.needs_input_grad[1] else None
        grad_w_up = d_up.t() @ flat_h if ctx.needs_input_grad[2] else None
        grad_h = None
        if ctx.needs_input_grad[0]:
            grad_h = torch.addmm(d_gate @ w_gate, d_up, w_up).reshape(h.shape)
        return grad_h, grad_w_gate, grad_w_up, grad_w_down, None


def gated_mlp(mlp, h: torch.Tensor, grads_fn=silu_mul_grads) -> torch.Tensor:
    """``mlp.down_proj(silu(mlp.gate_proj(h)) * mlp.up_proj(h))``, keeping ``2 I`` values a token for the backward
    pass (module docstring). ``grads_fn``: ``silu_mul_grads``, or a compiled form of it."""
    return _GatedMLP.apply(h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, grads_fn)
