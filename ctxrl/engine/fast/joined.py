"""The engine's projection weights laid end to end: one matrix product for q, k and v, one for gate and up.

A decode step at batch 256 on Qwen2.5-0.5B is bound by how many kernels it runs, not by the bytes they read
(``docs/performance.md``): the k and v projections are two products of 128 outputs each, a few microseconds
of launch and tail apiece for almost no work. Laid end to end, ``[q; k; v]`` is one product whose output
columns are q's, then k's, then v's; ``[gate; up]`` one whose first half is the gate's.

The engine owns its model (``spec_engine`` hands it over), so no copy is kept: the joined tensor is allocated
once and each module's parameter becomes a view of its rows. ``load_weights`` copies new weights into the
parameters in place, so they land in the joined tensors and captured graphs stay valid. A layer whose
projections are not plain ``nn.Linear`` modules alike (dtype, device, bias or none) keeps its modules' own
products (``None`` here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Joined:
    """One product's weight (and bias) and the widths of its parts' outputs, in order."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    widths: tuple[int, ...]


def join(modules: list[torch.nn.Module]) -> Joined | None:
    """``modules``' weights (and biases) as one tensor each, the modules' parameters re-pointed to views of them;
    ``None`` (nothing changed) where they are not plain linear layers alike."""
    if any(type(m) is not torch.nn.Linear for m in modules):
        return None
    first = modules[0].weight
    if any(m.weight.dtype != first.dtype or m.weight.device != first.device or m.in_features != modules[0].in_features
           for m in modules):
        return None
    biases = [m.bias for m in modules]
    biased = biases[0] is not None
    if any((b is not None) != biased or (biased and b.dtype != first.dtype) for b in biases):
        return None
    widths = tuple(m.out_features for m in modules)
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in modules])
        bias = torch.cat([b.detach() for b in biases]) if biased else None
        start = 0
        for m, width in zip(modules, widths):
            m.weight.data = weight[start:start + width]
            if bias is not None:
                m.bias.data = bias[start:start + width]
            start += width
    return Joined(weight, bias, widths)


@dataclass
class JoinedLayer:
    """A decoder layer's joined products (``None``: that part runs through its modules)."""

    qkv: Joined | None
    gate_up: Joined | None


def join_layer(layer) -> JoinedLayer:
    """Join a Llama-layout layer's q/k/v and gate/up projections (see the module docstring)."""
    attn, mlp = layer.self_attn, layer.mlp
    halves = getattr(mlp.gate_proj, "out_features", None) == getattr(mlp.up_proj, "out_features", -1)
    return JoinedLayer(qkv=join([attn.q_proj, attn.k_proj, attn.v_proj]),
                       gate_up=join([mlp.gate_proj, mlp.up_proj]) if halves else None)
