"""The output head's log-probs in one pass over the vocabulary: a linear layer and log-softmax fused by hand.

``token_logprobs`` needs, for each scored position, ``log softmax(h W^T / T)[target]`` (and the
entropy as a figure). Done with autograd's building blocks, each chunk of positions costs a dozen
passes over a ``[chunk, V]`` tensor: the float32 copy of the logits, the log-sum-exp, the
entropy's softmax and product, and in the backward pass the recomputed forward under
checkpointing, the softmax again, the subtraction and the cast back. With Qwen's 152k vocabulary
those passes, not the matrix products, were the largest share of a 0.5B model's update
(docs/performance.md).

``linear_logprobs`` is an ``autograd.Function`` that needs none of that:

- forward: the logits ``[n, V]`` in the model's dtype, then one reduction for the log-sum-exp,
  the target's logit and (optionally, without a gradient) the entropy, in float32; the logits
  are freed, and only the hidden states (already held) and the log-sum-exp ``[n]`` are saved;
- backward: the logits recomputed by one matrix product, ``d logits = (onehot - softmax) * g / T``
  in one element-wise pass (in the model's dtype, as autograd's would be), then the two matrix
  products for the hidden states' and the weight's gradients.

The arithmetic is the unfused path's (float32 statistics over the model-dtype logits); on CUDA the
two element-wise steps are compiled (``torch.compile``, dynamic shapes), elsewhere they run eagerly.
An entropy the loss differentiates (``algo.entropy_coef > 0``) uses the unfused path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ctxrl.models.fused import guarded_compile


def _stats_fn(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    x = logits if logits.dtype == torch.float64 else logits.float()
    if temperature != 1.0:
        x = x / temperature
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return lse, target, torch.zeros_like(lse)
    p = torch.exp(x - lse.unsqueeze(-1))
    return lse, target, lse - (p * x).sum(-1)


def _grad_fn(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
             temperature: float) -> torch.Tensor:
    x = logits if logits.dtype == torch.float64 else logits.float()
    if temperature != 1.0:
        x = x / temperature
    p = torch.exp(x - lse.unsqueeze(-1))
    onehot = torch.arange(x.shape[-1], device=x.device).unsqueeze(0) == targets.unsqueeze(-1)
    return ((onehot.to(x.dtype) - p) * (grad / temperature).unsqueeze(-1)).to(logits.dtype)


_EAGER = {"stats": _stats_fn, "grad": _grad_fn}


@functools.cache
def _compiled(name: str):
    return guarded_compile(_EAGER[name], f"the output head's {name}", fullgraph=False)


def _run(name: str, *args):
    """The compiled element-wise step on CUDA (eager if compilation fails), eager elsewhere."""
    return (_compiled(name) if args[0].is_cuda else _EAGER[name])(*args)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, states, weight, bias, targets, temperature: float, with_entropy: bool):
        logits = F.linear(states, weight, bias)
        lse, target, entropy = _run("stats", logits, targets, temperature, with_entropy)
        ctx.save_for_backward(states, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return target - lse, entropy

    @staticmethod
    def backward(ctx, grad, _entropy_grad):
        states, weight, bias, targets, lse = ctx.saved_tensors
        logits = F.linear(states, weight, bias)
        d_logits = _run("grad", logits, targets, lse, grad, ctx.temperature)
        del logits
        d_states = d_logits @ weight if ctx.needs_input_grad[0] else None
        d_weight = d_logits.t() @ states if ctx.needs_input_grad[1] else None
        d_bias = d_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return d_states, d_weight, d_bias, None, None, None


def linear_logprobs(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-prob of targets, entropy)`` ``[n]`` each, of ``softmax((states @ weight.T + bias) / temperature)``;
    differentiable in the log-probs only (float32, or float64 for a float64 model)."""
    return _LinearLogprobs.apply(states, weight, bias, targets, float(temperature), bool(with_entropy))
